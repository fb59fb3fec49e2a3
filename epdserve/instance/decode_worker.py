"""D worker: reserves KV blocks for a request prefilled elsewhere, then decodes and streams it.

An adapter between the Decode RPC stream and the engine:
    reserve  the pair to the P peer built or reused (`LayerwiseRecvConnector.pair_for`: this
             side names it "<P id>><D id>/g<n>", n growing with every rebuild; a peer whose pair
             was rebuilt too often lately fails the call as retryable: the scheduler reroutes
             it); the engine takes
             the request with `RemotePrefill` (and its media's identity, `media_identity`, so
             that the KV it imports is cached under the same keys as P's), starts it on the
             longest prefix of its prompt this engine's prefix cache holds (an earlier turn's
             imported or decoded KV), reserves blocks for the rest of prompt + max_tokens (so an
             imported request is never preempted) and its connector expects the KV there; the
             reservation (prompt blocks, the cached tokens P need not send, block size, pair)
             goes back to the scheduler
    begin    the first token and M-RoPE delta from P reach the connector; once the KV is in too,
             the engine decodes
    stream   every engine output to the handle; a failed transfer fails the request as
             retryable (the scheduler retries); abort frees the blocks, or holds them until KV
             still arriving into them has landed
"""
from __future__ import annotations

from concurrent.futures import Future
from dataclasses import dataclass

from epdserve.engine.engine_request import EngineRequest
from epdserve.engine.request_parts import TenantShare
from epdserve.engine.sampling_params import SamplingParams
from epdserve.instance.errors import BusyError, TransientError
from epdserve.instance.worker import CALL_TIMEOUT_S, RequestHandle, StageWorker
from epdserve.rpc.video_spec import video_timing
from epdserve.seams.kv_connector import RemotePrefill
from epdserve.seams.prefix_hash import media_extra
from epdserve.transfer.kv import KVTransferConfig, LayerwiseRecvConnector, PairRendezvous
from epdserve.transfer.kv.recv_connector import PairRebuildsExhausted


@dataclass(frozen=True)
class Reservation:
    block_ids: tuple[int, ...]
    block_size: int
    rdzv: PairRendezvous  # the P side's view (rank 0)
    num_cached_tokens: int = 0  # the first tokens' KV is here already (whole blocks): P sends the rest


def media_identity(refs) -> tuple[tuple[str, str, int], ...]:
    """(key, extra, num_tokens) per `MediaRef` (data ignored) in prompt order: the prefix cache's
    identity of each media item (`seams/prefix_hash.py`), the one the prefilling engine and the
    router hash too (a video's timing is its sampling spec: `video_timing`)."""
    return tuple((r.key, media_extra(r.grid_thw, video_timing(r.video) if r.HasField("video") else None),
                  int(r.num_tokens)) for r in refs)


class DecodeWorker(StageWorker):
    role = "D"

    def __init__(self, name, engine_factory, cores=None, *, instance_id: str, kv_config: KVTransferConfig | None = None):
        super().__init__(name, engine_factory, cores)
        self.instance_id = instance_id
        self.kv_config = kv_config or KVTransferConfig()

    def make_connector(self) -> LayerwiseRecvConnector:
        return LayerwiseRecvConnector(self.instance_id, self.kv_config)

    # ---------------------------------------------------------------- gRPC threads
    def reserve(self, request_id: str, prompt_ids: list[int], params: SamplingParams, peer: str, kv_host: str,
                kv_port: int, num_vision_tokens: int = 0, media: tuple = (), cache_salt: str = "",
                tenant: TenantShare = TenantShare(), p_degree: int = 1) -> tuple[RequestHandle, Reservation]:
        """`media`: `media_identity` of the request's media (empty: a prompt with media is not cached);
        `cache_salt`: the request's (its first block's hash, as at P); `p_degree`: P's tensor-parallel
        degree (every rank of both instances joins the pair)."""
        handle = RequestHandle(request_id, params.n)

        def run() -> Reservation:
            if request_id in self.handles:
                raise ValueError(f"request {request_id!r} is already in flight here")
            try:
                rdzv = self.connector.pair_for(peer, kv_host, kv_port, p_degree)
            except PairRebuildsExhausted as e:  # retryable: the scheduler reroutes the request
                raise TransientError(str(e)) from None
            req = EngineRequest(request_id, list(prompt_ids), [], params, kv_transfer=RemotePrefill(peer),
                                num_vision_tokens=num_vision_tokens, media_identity=tuple(media),
                                cache_salt=cache_salt, tenant=tenant)
            try:
                self.engine.add_request(req)
            except MemoryError as e:
                raise BusyError(str(e)) from None
            self.handles[request_id] = handle
            return Reservation(self.connector.reserved_blocks(request_id), self.engine.config.block_size,
                               rdzv.for_peer(), self.connector.cached_tokens(request_id))

        return handle, self.call(run).result(CALL_TIMEOUT_S)

    def begin(self, request_id: str, first_token: int, rope_delta: int, choice_tokens=()) -> Future:
        """`choice_tokens`: n > 1, the first tokens P sampled for choices 1..n-1."""
        def run() -> None:
            try:
                self.connector.set_first_token(request_id, first_token, rope_delta, choice_tokens)
            except KeyError:
                raise TransientError(f"request {request_id!r} is not reserved here (any more)") from None

        return self.call(run)
