"""A minimal coupled (EPD) instance for scheduler tests: a real LLMEngine behind a real gRPC
server on a free loopback port, serving Instance.Generate / Abort / GetLoad (+ health,
reflection). Not a mock: every token comes from the engine; only the instance process
machinery (workers, core pinning, MM Store, registration thread) is left to epdserve.instance.

`EngineInstance.kill()` stops the server at once (calls in flight fail with UNAVAILABLE), which
is what a dying instance looks like to the scheduler.
"""
from __future__ import annotations

import queue
import threading
from concurrent import futures

import grpc
import torch

from epdserve.engine.config import EngineConfig
from epdserve.engine.engine_request import EngineRequest
from epdserve.engine.llm_engine import LLMEngine
from epdserve.engine.request_parts import MediaItem
from epdserve.instance.sampling_wire import sampling_from_proto
from epdserve.rpc import INSTANCE_SERVICE, common_pb2, instance_pb2, instance_pb2_grpc
from epdserve.rpc.servers import add_health_and_reflection, free_port, set_serving


class _Servicer(instance_pb2_grpc.InstanceServicer):
    def __init__(self, inst: EngineInstance):
        self.inst = inst

    def Generate(self, request, context):
        q = self.inst.submit(request)
        context.add_callback(lambda: self.inst.abort(request.request_id))
        while True:
            out = q.get()
            if isinstance(out, ConnectionError):  # killed while the call was still open
                context.abort(grpc.StatusCode.UNAVAILABLE, str(out))
            if isinstance(out, BaseException):
                context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(out))
            if out.finish_reason == "error":
                context.abort(grpc.StatusCode.INVALID_ARGUMENT, out.error or "error")
            d = instance_pb2.TokenDelta(
                request_id=out.request_id, token_ids=out.new_token_ids, text=out.new_text, finished=out.finished,
                finish_reason=out.finish_reason or "" if out.finished else "", num_prompt_tokens=out.num_prompt_tokens,
                num_vision_tokens=out.num_vision_tokens, num_cached_vision_tokens=out.num_cached_vision_tokens,
                num_cached_tokens=out.num_cached_tokens,
            )
            for k in ("encode_start", "encode_end", "first_token"):
                if out.timings.get(k):
                    setattr(d.timings, k, out.timings[k])
            yield d
            if out.finished:
                return

    def Abort(self, request, context):
        return instance_pb2.InstanceAbortResponse(found=self.inst.abort(request.request_id))

    def GetLoad(self, request, context):
        return self.inst.status()


KV_CACHE_BYTES = 64 << 20  # ~130k tokens of the tiny model; the default 1 GiB, times the instances a
# worker holds at once, took a CI worker past 12 GB


class EngineInstance:
    def __init__(self, model_dir: str, instance_id: str, **engine_kwargs):
        self.instance_id = instance_id
        engine_kwargs.setdefault("kv_cache_bytes", KV_CACHE_BYTES)
        self.engine = LLMEngine(EngineConfig(model=str(model_dir), device="cpu", roles="EPD", **engine_kwargs))
        self.port = free_port()
        self.address = f"127.0.0.1:{self.port}"
        self.requests_seen: list[str] = []
        self.aborted: list[str] = []
        self._inbox: queue.SimpleQueue = queue.SimpleQueue()
        self._queues: dict[str, queue.SimpleQueue] = {}
        self._stop = threading.Event()
        self._loop = threading.Thread(target=self._run, daemon=True)
        self.server = grpc.server(futures.ThreadPoolExecutor(max_workers=32))
        instance_pb2_grpc.add_InstanceServicer_to_server(_Servicer(self), self.server)
        self.health = add_health_and_reflection(self.server, [INSTANCE_SERVICE])
        set_serving(self.health, [INSTANCE_SERVICE])
        self.server.add_insecure_port(self.address)

    def start(self) -> EngineInstance:
        self._loop.start()
        self.server.start()
        return self

    def status(self) -> common_pb2.InstanceStatus:
        rep = self.engine.load_report()
        return common_pb2.InstanceStatus(
            instance_id=self.instance_id, roles="EPD", address=self.address, model=str(self.engine.config.model),
            media_namespace=self.engine.model.namespace,
            load=common_pb2.Load(running_requests=rep["running"], waiting_requests=rep["waiting"],
                                 free_kv_blocks=rep["free_kv_blocks"], total_kv_blocks=rep["total_kv_blocks"],
                                 prefix_queried_tokens=rep["prefix_queried_tokens"],
                                 prefix_hit_tokens=rep["prefix_hit_tokens"]),
        )

    # ---------------------------------------------------------------- engine loop (one thread)
    def submit(self, req: instance_pb2.InstanceGenerateRequest) -> queue.SimpleQueue:
        q: queue.SimpleQueue = queue.SimpleQueue()
        self._inbox.put(("add", req, q))
        return q

    def abort(self, request_id: str) -> bool:
        self._inbox.put(("abort", request_id, None))
        return True

    def _run(self) -> None:
        eng = self.engine
        while not self._stop.is_set():
            busy = eng.has_unfinished()
            try:
                kind, arg, q = self._inbox.get(timeout=0.0 if busy else 0.05)
            except queue.Empty:
                kind = None
            if kind == "add":
                try:
                    media = [self._media(m) for m in arg.media]
                    self._queues[arg.request_id] = q
                    self.requests_seen.append(arg.request_id)
                    eng.add_request(EngineRequest(arg.request_id, list(arg.prompt_token_ids), media,
                                                  sampling_from_proto(arg.sampling)))
                except Exception as e:  # bad input fails this request only
                    self._queues.pop(arg.request_id, None)
                    q.put(e)
            elif kind == "abort":
                if arg in self._queues:
                    self.aborted.append(arg)
                    eng.abort(arg)
            if eng.has_unfinished():
                for out in eng.step():
                    q = self._queues.get(out.request_id)
                    if q is not None:
                        q.put(out)
                        if out.finished:
                            self._queues.pop(out.request_id, None)

    def _media(self, ref: instance_pb2.MediaRef) -> MediaItem:
        if ref.data:
            return self.engine.media_item(self.engine.processor.preprocess_image(bytes(ref.data)), key=ref.key)
        # sent by key: the features must be in this engine's feature cache (nothing to recompute from)
        return MediaItem(key=ref.key, input=None, num_tokens=ref.num_tokens, grid_thw=torch.tensor(list(ref.grid_thw)))

    # ---------------------------------------------------------------- lifecycle
    def kill(self) -> None:
        """Die: stop serving at once (in-flight calls fail), stop the engine loop."""
        self.server.stop(0)
        self._stop.set()
        self._loop.join(10)
        for q in list(self._queues.values()):  # wake handlers still waiting (their calls are gone)
            q.put(ConnectionError("instance killed"))  # what a dead process's calls end with: UNAVAILABLE

    stop = kill
