"""P worker: prefills requests and sends their KV to the decode instance layer by layer.

Request lifecycle (SGLang-style, each stage a dict keyed by request id):
    bootstrapping  the pair to the request's D peer is being built (D named it in the
                   reservation; a newer generation replaces an older pair)
    in engine      features (MM Store prefetch, bounded wait, else recompute), then prefill;
                   the `LayerwiseSendHook` sends each layer's KV into D's reserved blocks
    held           first token out (the handle gets it: TTFT) and the KV parked at KV_HELD
                   until D acknowledged the transfer, or it failed; then `release`d
A first token that already ends the request frees the blocks at once (D's reservation is
closed by the scheduler). Abort frees a request's blocks unless a transfer may still read
them, in which case they go when the transfer finishes.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass, replace

from epdserve.engine.sampling_params import SamplingParams
from epdserve.engine.sequence import MediaItem
from epdserve.instance.errors import TransientError, output_error
from epdserve.instance.kv_hook import Destination, LayerwiseSendHook
from epdserve.instance.worker import CALL_TIMEOUT_S, RequestHandle, StageWorker
from epdserve.transfer.kv import KVSender, KVTransferConfig, PairRendezvous, PairState

log = logging.getLogger(__name__)


@dataclass
class PrefillJob:
    request_id: str
    token_ids: list[int]
    media: list[MediaItem]
    params: SamplingParams
    peer: str  # decode instance id
    dst_block_ids: tuple[int, ...]
    rdzv: PairRendezvous  # rank 0 (this side)


@dataclass
class PrefillResult:
    output: object  # the engine's RequestOutput with the first token
    rope_delta: int
    recomputed_keys: list[str]


def pair_generation(name: str) -> int:
    """Pair names end in "/g<n>" (see DecodeWorker); a missing suffix counts as 0."""
    head, sep, gen = name.rpartition("/g")
    return int(gen) if sep and gen.isdigit() else 0


class PrefillWorker(StageWorker):
    role = "P"

    def __init__(self, name, engine_factory, cores=None, kv_config: KVTransferConfig | None = None):
        super().__init__(name, engine_factory, cores)
        self.kv_config = kv_config or KVTransferConfig()
        self.sender: KVSender | None = None
        self.hook: LayerwiseSendHook | None = None
        self.pair_names: dict[str, str] = {}  # peer -> current pair name
        self.bootstrapping: dict[str, PrefillJob] = {}
        self.jobs: dict[str, PrefillJob] = {}  # in the engine
        self.held: set[str] = set()  # KV_HELD, transfer running
        self.transfer_done: set[str] = set()  # finished before we saw the first token

    def on_start(self) -> None:
        self.sender = KVSender(self.engine.kv_cache, self.engine.platform, self.kv_config)
        self.hook = LayerwiseSendHook(self.engine, self.sender)

    # ---------------------------------------------------------------- gRPC threads
    def submit(self, job: PrefillJob) -> RequestHandle:
        handle = RequestHandle(job.request_id)
        self.call(lambda: self._admit(job, handle)).result(CALL_TIMEOUT_S)
        return handle

    def abort(self, request_id: str):
        return self.call(lambda: self._abort(request_id))

    # ---------------------------------------------------------------- loop thread
    def _admit(self, job: PrefillJob, handle: RequestHandle) -> None:
        rid = job.request_id
        if rid in self.handles:
            raise ValueError(f"request {rid!r} is already in flight here")
        current = self.pair_names.get(job.peer)
        state = self.sender.pair_state(job.peer)
        if current != job.rdzv.pair_name:
            if current is not None and state in (PairState.READY, PairState.CONNECTING) \
                    and pair_generation(job.rdzv.pair_name) < pair_generation(current):
                raise TransientError(f"stale KV pair {job.rdzv.pair_name!r} (current {current!r})")
            self.sender.connect(job.peer, job.rdzv)
            self.pair_names[job.peer] = job.rdzv.pair_name
        self.handles[rid] = handle
        self.bootstrapping[rid] = job

    def _abort(self, request_id: str) -> bool:
        handle = self.handles.pop(request_id, None)
        if self.bootstrapping.pop(request_id, None) is None and request_id in self.jobs:
            self.jobs.pop(request_id)
            self.hook.forget(request_id)
            self.engine.abort(request_id)  # before its prefill completed: no transfer reads the blocks
        if handle is not None:
            handle.put(TransientError("aborted"))
        return handle is not None

    def has_engine_work(self) -> bool:
        return self.engine.has_unfinished() or any(
            self.sender.pair_state(j.peer) is PairState.READY for j in self.bootstrapping.values())

    def has_pending_transfers(self) -> bool:
        return bool(self.bootstrapping or self.held)

    def tick(self) -> None:
        self._admit_connected()
        for out in self.engine.step():
            if out.finished:
                self._on_first_token(out)
        self._transfers()

    def _admit_connected(self) -> None:
        for rid, job in list(self.bootstrapping.items()):
            state = self.sender.pair_state(job.peer)
            if state is PairState.CONNECTING:
                continue
            del self.bootstrapping[rid]
            if state is not PairState.READY:
                why = self.sender.status(rid)
                self._fail(rid, TransientError(f"KV pair to decode instance {job.peer} is {state and state.value}"
                                               f"{': ' + why.error if why and why.error else ''}"))
                continue
            self.jobs[rid] = job
            self.hook.expect(rid, Destination(job.peer, job.dst_block_ids))
            self.engine.add_processed(rid, job.token_ids, job.media, job.params)

    def _on_first_token(self, out) -> None:
        rid = out.request_id
        job = self.jobs.pop(rid, None)
        self.hook.forget(rid)
        refused = self.hook.refused.pop(rid, None)
        handle = self.handles.pop(rid, None)
        if out.finish_reason == "prefill_done":
            if refused is not None or rid in self.transfer_done or rid not in self.hook.started:
                self.transfer_done.discard(rid)
                self.hook.started.discard(rid)
                self.engine.release(rid)
            else:
                self.held.add(rid)
        if handle is None:
            return
        if out.finish_reason == "error":
            handle.put(output_error(out))
        elif refused is not None:
            handle.put(TransientError(f"KV transfer refused: {refused}"))
        else:
            recomputed = [m.key for m in (job.media if job else []) if not m.from_store]
            handle.put(PrefillResult(out, out.rope_delta, recomputed))

    def _transfers(self) -> None:
        for st in self.sender.pop_finished():
            rid = st.request_id
            self.hook.started.discard(rid)
            if st.error:
                log.warning("KV transfer of %s to %s failed: %s", rid, st.peer, st.error)
            if rid in self.held:
                self.held.discard(rid)
                self.engine.release(rid)
            elif rid in self.jobs:  # finished before its first token was seen (same step)
                self.transfer_done.add(rid)

    def _fail(self, rid: str, exc: BaseException) -> None:
        handle = self.handles.pop(rid, None)
        if handle is not None:
            handle.put(exc)

    def on_step_error(self) -> None:
        self.hook.abort_open_batch("prefill step failed")
        for rid in list(self.jobs):
            self.jobs.pop(rid)
            self.hook.forget(rid)
            self.engine.abort(rid)
            self._fail(rid, TransientError("prefill step failed"))

    def on_stop(self) -> None:
        for rid in list(self.handles):
            self._fail(rid, RuntimeError("prefill worker stopped"))
        if self.sender is not None:
            self.sender.close()

    def compute_load(self):
        load = self.engine_load(held=len(self.held))
        waiting = len(self.bootstrapping)
        queued = sum(len(j.token_ids) for j in self.bootstrapping.values())
        return replace(load, waiting=load.waiting + waiting, queued_tokens=load.queued_tokens + queued)
