"""`StageWorker`: one stage's loop thread — its own queue, its own engine, its own cores.

Threading contract: the engine is touched only by the worker's loop thread. gRPC handler
threads talk to it through `call(fn)` (runs `fn()` on the loop thread, returns a Future) and
read results from per-request `RequestHandle` queues the loop fills. Load is published as an
immutable snapshot after every loop iteration, so reading it never races the engine.

Loop: pin the thread to the worker's cores → build the KV connector (`make_connector`, P and
D) and the engine over the process's shared model → when co-located on an accelerator, open
the worker's own stream (on NPU limited to `device_share` of the AI Cores and Vector Cores) →
repeat { run queued calls; `tick()` (one engine step, its outputs to their handles; P first
admits the requests whose KV pair became ready); publish load }, all under that stream. When there is no engine work the loop
sleeps on its queue (with a short timeout while transfers are pending).
"""
from __future__ import annotations

import logging
import os
import queue
import threading
import time
from concurrent.futures import Future
from contextlib import nullcontext as _nullcontext
from dataclasses import dataclass, field
from typing import Callable

from epdserve.engine.engine_request import EngineRequest
from epdserve.engine.outputs import RequestOutput
from epdserve.engine.tp.group import RankFailure
from epdserve.instance.colocation import enter_stage_thread
from epdserve.instance.errors import TransientError, output_error
from epdserve.instance.stage_stream import npu_stage_operators, open_stage_stream
from epdserve.roles import role_set
from epdserve.rpc import common_pb2

log = logging.getLogger(__name__)

CALL_TIMEOUT_S = 120.0  # longest wait for the loop thread to take a call (it runs between steps)
_POLL_S = 0.002  # queue wait while only transfers are pending
_IDLE_S = 0.5  # queue wait when nothing at all is pending
RANK_FAILURE_EXIT = 75  # a tensor-parallel rank died: the instance exits whole (EX_TEMPFAIL: try again)


@dataclass(frozen=True)
class WorkerLoad:
    """One worker's load snapshot: its counts as the gRPC `Load` message (summed per instance by
    `sum_loads`), the feature cache's hits and lookups (for the hit rate), and debugging extras."""

    counts: common_pb2.Load = field(default_factory=common_pb2.Load)
    cache_hits: int = 0
    cache_lookups: int = 0
    extra: dict = field(default_factory=dict)


def sum_loads(loads: list[WorkerLoad]) -> common_pb2.Load:
    """An instance's Load: every count summed over its workers; the hit rates over all lookups."""
    total = common_pb2.Load()
    for f in common_pb2.Load.DESCRIPTOR.fields:
        if f.name not in ("mm_cache_hit_rate", "prefix_cache_hit_rate"):
            setattr(total, f.name, sum(getattr(x.counts, f.name) for x in loads))
    lookups = sum(x.cache_lookups for x in loads)
    total.mm_cache_hit_rate = sum(x.cache_hits for x in loads) / lookups if lookups else 0.0
    queried = total.prefix_queried_tokens
    total.prefix_cache_hit_rate = total.prefix_hit_tokens / queried if queried else 0.0
    return total


def _add_counters(counts: common_pb2.Load, stats: dict, kv, role: str) -> None:
    """The engine's step counters and the KV connector's transfer totals (P sends, D receives)."""
    counts.engine_steps = int(stats["steps"])
    counts.engine_step_seconds = stats["host_s"] + stats["forward_s"]
    counts.vision_seconds = stats["vision_s"]
    counts.engine_step_requests = int(stats["batch_requests"])
    if kv is None:
        return
    rs = role_set(role)
    if rs.sends_kv:
        counts.kv_sent_bytes, counts.kv_send_failures = kv.bytes, kv.failures
    elif rs.receives_kv:
        counts.kv_received_bytes, counts.kv_recv_failures = kv.bytes, kv.failures
    if rs.sends_kv or rs.receives_kv:
        counts.kv_leaked_communicators = kv.leaked_communicators


class RequestHandle:
    """Where the loop thread puts one request's events for the gRPC thread serving it: the outputs
    of each of its `n` choices (SamplingParams.n, `RequestOutput.index`), until all n finished."""

    def __init__(self, request_id: str, n: int = 1):
        self.request_id = request_id
        self.n = n
        self.unfinished = n  # choices with no finished output yet (loop thread)
        self.events: queue.Queue = queue.Queue()
        self.closed = False

    def put(self, event) -> None:
        self.events.put(event)

    def get(self, timeout_s: float | None = None):
        return self.events.get(timeout=timeout_s)


class StageWorker:
    """Owns (does not subclass) its loop thread, so subclass names never clash with Thread's."""

    role = "?"

    def __init__(self, name: str, engine_factory: Callable[[object], object], cores: list[int] | None = None):
        self.name = name
        self._thread = threading.Thread(target=self._loop, name=name, daemon=True)
        self.engine_factory = engine_factory
        self.cores = cores
        self.colocated = False  # shares an accelerator with another worker: runs on its own stream
        self.device_share: float | None = None  # ... limited to this share of its cores (None: unlimited)
        self.stream_priority = 0  # ... at this priority (lower = higher; CUDA only: NPU streams have none)
        self.core_limits_opted_in = False  # NPU: limit although operators are unverified (--npu-core-limits)
        self.low_priority = False  # CPU: this worker's thread gives way to the others (SCHED_IDLE)
        self.stream = None
        self.engine = None  # built on the loop thread: engine_factory(connector)
        self.connector = None
        self.bound_cores: list[int] = []
        self.ready = threading.Event()
        self.start_error: BaseException | None = None
        self.load = WorkerLoad()
        self.handles: dict[str, RequestHandle] = {}  # touched by the loop thread only
        self._inbox: queue.SimpleQueue = queue.SimpleQueue()
        self._stopping = threading.Event()

    # ---------------------------------------------------------------- other threads
    def submit(self, req: EngineRequest) -> RequestHandle:
        """Queue `req` in the engine; its outputs go to the returned handle (bad input raises)."""
        handle = RequestHandle(req.request_id, req.params.n)

        def add():
            if req.request_id in self.handles:
                raise ValueError(f"request {req.request_id!r} is already in flight here")
            self.engine.add_request(req)
            self.handles[req.request_id] = handle

        self.call(add).result(CALL_TIMEOUT_S)
        return handle

    def abort(self, request_id: str) -> Future:
        """Abort a request (its handle gets TransientError); the Future says whether it was here."""
        return self.call(lambda: self._abort(request_id))

    def call(self, fn: Callable[[], object]) -> Future:
        """Run `fn()` on the loop thread; its result (or exception) lands in the Future."""
        fut: Future = Future()
        if self._stopping.is_set():
            fut.set_exception(RuntimeError(f"{self.name} is stopping"))
            return fut
        self._inbox.put((fn, fut))
        return fut

    def wait_ready(self, timeout_s: float | None = None) -> None:
        if not self.ready.wait(timeout_s):
            raise TimeoutError(f"{self.name} did not start within {timeout_s} s")
        if self.start_error is not None:
            raise RuntimeError(f"{self.name} failed to start: {self.start_error}") from self.start_error

    def start(self) -> "StageWorker":
        self._thread.start()
        return self

    def stop(self, timeout_s: float = 10.0) -> None:
        self._stopping.set()
        self._inbox.put(None)
        if self._thread.is_alive():
            self._thread.join(timeout_s)

    # ---------------------------------------------------------------- loop thread
    def _loop(self) -> None:
        try:
            self.bound_cores = enter_stage_thread(self.cores, self.low_priority)
            self.connector = self.make_connector()
            self.engine = self.engine_factory(self.connector)
            self._open_stream()
        except BaseException as e:  # reported through wait_ready
            log.exception("%s failed to start", self.name)
            self.start_error = e
            self.ready.set()
            return
        log.info("%s ready on cores %s", self.name, self.bound_cores)
        self._publish_load()
        self.ready.set()
        try:
            with self.engine.platform.stream_context(self.stream) if self.stream is not None else _nullcontext():
                while not self._stopping.is_set():
                    if not self._run_calls(self._wait_s()):
                        break
                    try:
                        self.tick()
                    except RankFailure as e:  # half a model cannot serve: the instance ends, its supervisor restarts it
                        self.on_step_error()
                        log.critical("%s: %s; the instance exits (status %d) to be restarted whole", self.name, e,
                                     RANK_FAILURE_EXIT)
                        logging.shutdown()
                        os._exit(RANK_FAILURE_EXIT)
                    except Exception:
                        log.exception("%s: step failed", self.name)
                        self.on_step_error()
                    self._publish_load()
        finally:
            self._drain_on_stop()
            try:
                self.on_stop()
            except Exception:
                log.exception("%s: shutdown failed", self.name)
            if self.stream is not None:  # the platform may hand it to a later worker (NPU: npu_streams.py)
                self.engine.platform.release_stream(self.stream)

    def _open_stream(self) -> None:
        """Co-located on an accelerator: run on an own stream, limited to `device_share` (NPU)."""
        if self.colocated:
            platform = self.engine.platform
            operators = npu_stage_operators(platform, self.role, getattr(getattr(self.engine, "runner", None), "ops", None))
            self.stream = open_stage_stream(platform, self.device_share, self.name, self.stream_priority, operators,
                                            opted_in=self.core_limits_opted_in)

    def _wait_s(self) -> float | None:
        if self.has_engine_work():
            return 0.0
        return _POLL_S if self.has_pending_transfers() else _IDLE_S

    def _run_calls(self, wait_s: float) -> bool:
        """Run queued calls (waiting up to `wait_s` for the first); False once asked to stop."""
        try:
            item = self._inbox.get(timeout=wait_s) if wait_s > 0 else self._inbox.get_nowait()
        except queue.Empty:
            return True
        while True:
            if item is None:
                return False
            fn, fut = item
            if fut.set_running_or_notify_cancel():
                try:
                    fut.set_result(fn())
                except BaseException as e:
                    fut.set_exception(e)
            try:
                item = self._inbox.get_nowait()
            except queue.Empty:
                return True

    def _drain_on_stop(self) -> None:
        while True:
            try:
                item = self._inbox.get_nowait()
            except queue.Empty:
                break
            if item is not None:
                item[1].set_exception(RuntimeError(f"{self.name} stopped"))

    def _publish_load(self) -> None:
        try:
            self.load = self.compute_load()
        except Exception:  # never let a stats bug stop serving
            log.debug("%s: load snapshot failed", self.name, exc_info=True)

    def engine_load(self, counts_kv: bool = True, **extra) -> WorkerLoad:
        """A snapshot from the engine's load report (loop thread only)."""
        r = self.engine.load_report()
        stats = self.engine.features.stats() if self.engine.features is not None else None
        hits = stats.hits if stats is not None else 0
        lookups = stats.lookups if stats is not None else 0
        counts = common_pb2.Load(  # an E worker's tiny cache holds no request KV (counts_kv False): not capacity
            queued_tokens=r["queued_tokens"], running_requests=r["running"], waiting_requests=r["waiting"],
            free_kv_blocks=r["free_kv_blocks"] if counts_kv else 0,
            total_kv_blocks=r["total_kv_blocks"] if counts_kv else 0,
            queued_media=r["queued_media"], images_encoded=r["encoder_runs"],
            prefix_queried_tokens=r["prefix_queried_tokens"], prefix_hit_tokens=r["prefix_hit_tokens"],
        )
        _add_counters(counts, self.engine.stats.as_dict(), getattr(self.connector, "counters", None), self.role)
        g = self.engine.runner.graph_report()
        counts.decode_graph_keys, counts.decode_graph_capture_seconds = g["keys"], g["capture_s"]
        counts.decode_graph_replays, counts.eager_decode_steps = g["replays"], sum(g["eager_decode_steps"].values())
        return WorkerLoad(counts, hits, lookups, extra={
            "recomputes": r["recomputes"], "held": r["held"], "in_flight": len(self.handles), "at": time.time(), **extra})

    # ---------------------------------------------------------------- loop thread, overridable
    def make_connector(self):
        """The engine's KV connector (P and D workers), or None."""
        return None

    def _abort(self, request_id: str) -> bool:
        handle = self.handles.pop(request_id, None)
        self.engine.abort(request_id)
        if handle is not None:
            handle.put(TransientError("aborted"))
        return handle is not None

    def tick(self) -> None:
        for out in self.engine.step():
            self.deliver(out)

    def deliver(self, out: RequestOutput) -> None:
        """One engine output to its request's handle (an error output as the exception); the handle
        is done here once every choice of the request finished."""
        handle = self.handles.get(out.request_id)
        if handle is None:
            return
        if out.finished:
            handle.unfinished -= 1
            if handle.unfinished <= 0:
                del self.handles[out.request_id]
        handle.put(output_error(out) if out.error is not None else out)

    def on_step_error(self) -> None:
        """A tick raised outside the engine's step: fail what this worker holds (the loop goes on)."""
        for rid, handle in list(self.handles.items()):
            self.engine.abort(rid)
            handle.put(TransientError(f"{self.name} step failed"))
        self.handles.clear()

    def on_stop(self) -> None:
        """At exit: fail every request still in flight, close the connector."""
        for handle in self.handles.values():
            handle.put(RuntimeError(f"{self.name} stopped"))
        self.handles.clear()
        if self.connector is not None:
            self.connector.close()

    def has_engine_work(self) -> bool:
        return self.engine.has_unfinished()

    def has_pending_transfers(self) -> bool:
        return self.engine.has_pending_transfers()

    def compute_load(self) -> WorkerLoad:
        return self.engine_load()
