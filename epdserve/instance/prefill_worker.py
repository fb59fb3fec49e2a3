"""P worker: prefills requests whose KV a decode instance reserved, and sends it there layerwise.

An adapter between the Prefill RPC and the engine: the request waits here only while the KV
pair to its decode peer is being built (`bootstrapping`; the rendezvous came with D's
reservation, and a newer pair generation replaces an older one); then it goes to the engine
with `RemoteDecode`, whose `LayerwiseSendConnector` sends each layer's KV during the forward.
The handle gets the engine's output carrying the first token (TTFT); the engine holds the
blocks until D acknowledged the transfer (or it failed), and a transfer that failed before the
first token fails the request as retryable.
"""
from __future__ import annotations

from epdserve.engine.engine_request import EngineRequest
from epdserve.instance.errors import TransientError
from epdserve.instance.worker import CALL_TIMEOUT_S, RequestHandle, StageWorker
from epdserve.seams.kv_connector import RemoteDecode
from epdserve.transfer.kv import KVTransferConfig, LayerwiseSendConnector, PairRendezvous, PairState, StalePairError


class PrefillWorker(StageWorker):
    role = "P"

    def __init__(self, name, engine_factory, cores=None, kv_config: KVTransferConfig | None = None):
        super().__init__(name, engine_factory, cores)
        self.kv_config = kv_config or KVTransferConfig()
        self.bootstrapping: dict[str, EngineRequest] = {}  # waiting for the pair to its D peer

    def make_connector(self) -> LayerwiseSendConnector:
        return LayerwiseSendConnector(self.kv_config)

    # ---------------------------------------------------------------- gRPC threads
    def prefill(self, req: EngineRequest, rdzv: PairRendezvous) -> RequestHandle:
        """`req.kv_transfer` is the RemoteDecode; `rdzv` the pair D named (this side's rank 0)."""
        handle = RequestHandle(req.request_id, req.params.n)

        def admit():
            if req.request_id in self.handles:
                raise ValueError(f"request {req.request_id!r} is already in flight here")
            try:
                self.connector.join(req.kv_transfer.peer, rdzv)
            except StalePairError as e:
                raise TransientError(str(e)) from None
            self.handles[req.request_id] = handle
            self.bootstrapping[req.request_id] = req

        self.call(admit).result(CALL_TIMEOUT_S)
        return handle

    # ---------------------------------------------------------------- loop thread
    def _abort(self, request_id: str) -> bool:
        self.bootstrapping.pop(request_id, None)
        return super()._abort(request_id)

    def has_engine_work(self) -> bool:
        return self.engine.has_unfinished() or any(
            self.connector.pair_state(self._peer(r)) is PairState.READY for r in self.bootstrapping.values())

    def has_pending_transfers(self) -> bool:
        return bool(self.bootstrapping) or self.engine.has_pending_transfers()

    def tick(self) -> None:
        self._admit_connected()
        super().tick()

    @staticmethod
    def _peer(req: EngineRequest) -> str:
        assert isinstance(req.kv_transfer, RemoteDecode)
        return req.kv_transfer.peer

    def _admit_connected(self) -> None:
        for rid, req in list(self.bootstrapping.items()):
            state = self.connector.pair_state(self._peer(req))
            if state is PairState.CONNECTING:
                continue
            del self.bootstrapping[rid]
            handle = self.handles.pop(rid)
            if state is not PairState.READY:
                why = self.connector.status(rid)
                handle.put(TransientError(f"KV pair to decode instance {self._peer(req)} is {state and state.value}"
                                          f"{': ' + why.error if why and why.error else ''}"))
                continue
            try:
                self.engine.add_request(req)
            except Exception as e:  # bad input: this request fails alone
                handle.put(e)
                continue
            self.handles[rid] = handle

    def compute_load(self):
        load = self.engine_load()  # a fresh snapshot, not yet published: ours to add to
        load.counts.waiting_requests += len(self.bootstrapping)
        load.counts.queued_tokens += sum(len(r.prompt_token_ids) for r in self.bootstrapping.values())
        return load
