"""D worker: reserves KV blocks, receives a prefilled request's KV, decodes and streams.

Request lifecycle:
    reserved   blocks for prompt + max_tokens taken from the engine's block manager (so an
               imported request is never preempted); the pair to the P peer built or reused
               (this side names it: "<P id>><D id>/g<n>", n growing with every rebuild) and
               the receiver told to `expect` the KV into the prompt's blocks
    started    the first token and rope_delta arrived (DecodeInput.start)
    importing  both the KV (receiver DONE) and the start are in: `add_prefilled_request` on the
               already-reserved blocks, `kv_ready`, and the engine decodes
    finished   the handle gets each engine output; the engine frees the blocks
A failed transfer frees the blocks and fails the request (TransientError: the scheduler
retries). Abort frees the blocks at once unless KV is still arriving into them; then they are
freed when the receiver reports the transfer finished.
"""
from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field, replace

from epdserve.engine.sampling_params import SamplingParams
from epdserve.instance.errors import BusyError, TransientError
from epdserve.instance.worker import CALL_TIMEOUT_S, RequestHandle, StageWorker
from epdserve.transfer.kv import KVReceiver, KVTransferConfig, PairRendezvous, PairState, RecvRequest, TransferState

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Reservation:
    block_ids: tuple[int, ...]
    block_size: int
    rdzv: PairRendezvous  # the P side's view (rank 0)


@dataclass
class _Request:
    handle: RequestHandle
    prompt_ids: list[int]
    params: SamplingParams
    peer: str
    num_vision_tokens: int
    first_token: int | None = None
    rope_delta: int = 0
    kv_done: bool = False
    in_engine: bool = False
    aborted: bool = False  # freed when the transfer finishes
    timings: dict = field(default_factory=dict)


class DecodeWorker(StageWorker):
    role = "D"

    def __init__(self, name, engine_factory, cores=None, *, instance_id: str, kv_config: KVTransferConfig | None = None):
        super().__init__(name, engine_factory, cores)
        self.instance_id = instance_id
        self.kv_config = kv_config or KVTransferConfig()
        self.receiver: KVReceiver | None = None
        self.requests: dict[str, _Request] = {}
        self.pairs: dict[str, PairRendezvous] = {}  # P peer -> current pair (our rank 1)
        self.generations: dict[str, int] = {}

    def on_start(self) -> None:
        self.receiver = KVReceiver(self.engine.kv_cache, self.engine.platform, self.kv_config)

    # ---------------------------------------------------------------- gRPC threads
    def reserve(self, request_id, prompt_ids, params, peer, kv_host, kv_port, num_vision_tokens=0):
        handle = RequestHandle(request_id)
        res = self.call(lambda: self._reserve(request_id, list(prompt_ids), params, peer, kv_host, kv_port,
                                              num_vision_tokens, handle)).result(CALL_TIMEOUT_S)
        return handle, res

    def begin(self, request_id: str, first_token: int, rope_delta: int):
        return self.call(lambda: self._start(request_id, first_token, rope_delta))

    def abort(self, request_id: str):
        return self.call(lambda: self._abort(request_id))

    # ---------------------------------------------------------------- loop thread
    def _reserve(self, rid, prompt_ids, params, peer, kv_host, kv_port, num_vision_tokens, handle) -> Reservation:
        if rid in self.requests:
            raise ValueError(f"request {rid!r} is already in flight here")
        blocks = self.engine.blocks
        total = min(len(prompt_ids) + params.max_tokens, self.engine.max_model_len)
        if len(prompt_ids) >= self.engine.max_model_len:
            raise BusyError(f"prompt of {len(prompt_ids)} tokens does not fit the context {self.engine.max_model_len}")
        if not blocks.can_grow(rid, total):
            raise BusyError(f"not enough free KV blocks for {total} tokens ({blocks.num_free} free)")
        rdzv = self._pair(peer, kv_host, kv_port)
        table = blocks.grow(rid, total)
        prompt_blocks = tuple(table[: blocks.blocks_needed(len(prompt_ids))])
        try:
            self.receiver.expect(RecvRequest(rid, peer, prompt_blocks, len(prompt_ids)))
        except ValueError:
            blocks.free(rid)
            raise
        self.requests[rid] = _Request(handle, prompt_ids, params, peer, num_vision_tokens)
        self.handles[rid] = handle
        return Reservation(prompt_blocks, blocks.block_size, rdzv.for_peer())

    def _pair(self, peer: str, host: str, port: int) -> PairRendezvous:
        cur = self.pairs.get(peer)
        state = self.receiver.pair_state(peer)
        if cur is not None and (cur.host, cur.port) == (host, port) and state in (PairState.CONNECTING, PairState.READY):
            return cur
        gen = self.generations.get(peer, -1) + 1
        self.generations[peer] = gen
        rdzv = PairRendezvous(host, int(port), f"{peer}>{self.instance_id}/g{gen}", 1)
        self.receiver.connect(peer, rdzv)
        self.pairs[peer] = rdzv
        return rdzv

    def _start(self, rid: str, first_token: int, rope_delta: int) -> None:
        req = self.requests.get(rid)
        if req is None or req.aborted:
            raise TransientError(f"request {rid!r} is not reserved here (any more)")
        req.first_token, req.rope_delta = int(first_token), int(rope_delta)
        self._maybe_import(rid, req)

    def _abort(self, rid: str) -> bool:
        req = self.requests.get(rid)
        if req is None or req.aborted:
            return False
        self.handles.pop(rid, None)
        req.handle.put(TransientError("aborted"))
        if req.in_engine:
            self.requests.pop(rid)
            self.engine.abort(rid)
        elif req.kv_done or self.receiver.cancel(rid):
            self.requests.pop(rid)
            self.engine.blocks.free(rid)
        else:  # KV may be arriving into the blocks: free them once the receiver is done
            req.aborted = True
        return True

    def _maybe_import(self, rid: str, req: _Request) -> None:
        if not req.kv_done or req.first_token is None or req.in_engine:
            return
        self.engine.add_prefilled_request(rid, req.prompt_ids, req.rope_delta, req.first_token, req.params,
                                          req.num_vision_tokens)
        req.in_engine = True
        self.engine.kv_ready(rid)

    def has_pending_transfers(self) -> bool:
        return any(not r.in_engine for r in self.requests.values())

    def tick(self) -> None:
        finished = self.receiver.pop_finished()
        if finished and self.engine.platform.name != "cpu":
            # the KV arrived on the backend's stream; make it visible to this worker's stream
            self.engine.platform.synchronize()
        for st in finished:
            req = self.requests.get(st.request_id)
            if req is None:
                continue
            if req.aborted or st.error is not None or st.state is not TransferState.DONE:
                self.requests.pop(st.request_id)
                self.engine.blocks.free(st.request_id)
                if not req.aborted:
                    self.handles.pop(st.request_id, None)
                    req.handle.put(TransientError(f"KV transfer from {st.peer} failed: {st.error}"))
                continue
            req.kv_done = True
            req.timings["kv_transfer_end"] = time.time()
            self._maybe_import(st.request_id, req)
        if not self.engine.has_unfinished():
            return
        for out in self.engine.step():
            req = self.requests.get(out.request_id)
            if req is None:
                continue
            if out.new_token_ids:
                req.timings.setdefault("first_decode", time.time())
            if out.finished:
                self.requests.pop(out.request_id)
                self.handles.pop(out.request_id, None)
            req.handle.put((out, dict(req.timings)))

    def on_step_error(self) -> None:
        for rid, req in list(self.requests.items()):
            if req.in_engine:
                self.requests.pop(rid)
                self.handles.pop(rid, None)
                self.engine.abort(rid)
                req.handle.put(TransientError("decode step failed"))

    def on_stop(self) -> None:
        for req in self.requests.values():
            req.handle.put(RuntimeError("decode worker stopped"))
        self.requests.clear()
        self.handles.clear()
        if self.receiver is not None:
            self.receiver.close()

    def compute_load(self):
        load = self.engine_load()
        pending = [r for r in self.requests.values() if not r.in_engine]
        return replace(load, waiting=load.waiting + len(pending))
