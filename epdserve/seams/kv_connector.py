"""The KV-connector seam: how an engine hands a request's KV to, or takes it from, another instance.

In the shape of vLLM v1's `KVConnectorBase_V1`, written for epdserve's engine. One connector
object serves both halves of one engine, each half called from the engine's own thread:

- the **scheduler side** decides with the block manager (which only the engine's `Scheduler`
  touches): how many of a request's tokens arrive from elsewhere, the blocks they arrive in,
  which requests of a step send their KV, and whether a finished request's blocks can be freed
  now or only once its transfer is over;
- the **worker side** runs inside the model runner's forward: start loading before it, wait
  for one layer before that layer's attention reads it, save one layer after that layer's KV
  is written, and report which requests finished sending or receiving.

Block ids reach an implementation only through these calls. Implementations live in
`epdserve.transfer.kv` (the layerwise sender is the prefill role, the receiver the decode
role). A request asks for a transfer with `Sequence.handoff.kv_transfer`: `RemoteDecode` (this engine
prefills, the KV goes to a decode peer) or `RemotePrefill` (the KV comes from a prefill peer).
"""
from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass


@dataclass(frozen=True)
class RemoteDecode:
    """Prefill role: send the prompt's KV to `peer`, into the blocks it reserved
    (`dst_block_ids`: one per prompt block, in order). The peer already holds the KV of the first
    `num_cached_tokens` prompt tokens (whole blocks, its prefix cache): only the rest is sent."""

    peer: str
    dst_block_ids: tuple[int, ...]
    num_cached_tokens: int = 0


@dataclass(frozen=True)
class RemotePrefill:
    """Decode role: the prompt's KV (and the first token) come from the prefill instance `peer`."""

    peer: str


@dataclass(frozen=True)
class FinishedTransfer:
    """One request whose transfer is over; nothing of the connector touches its blocks any more."""

    request_id: str
    error: str | None = None  # None: sent and acknowledged / received into the blocks
    first_token: int | None = None  # receiving: the first output token the prefill side sampled
    rope_delta: int = 0  # receiving: the prompt's M-RoPE delta (text position of token i = i + delta)
    choice_tokens: tuple[int, ...] = ()  # receiving, n > 1: the first tokens of choices 1..n-1


class KVConnector(ABC):
    """Contract of each method; every method is called on the engine's thread, never blocks long."""

    @abstractmethod
    def register_kv_cache(self, cache, platform) -> None:
        """Once, when the engine is built: the paged cache (engine.kv_cache.PagedKVCache) whose
        blocks the connector reads or writes, and the platform that names the backend."""

    def span_ranks(self, share, tell) -> None:
        """Tensor parallelism, before `register_kv_cache`: this engine is rank 0 of `share`'s degree
        (transfer/kv/links.py `KvShare`: the model's KV heads, the degree, rank 0) and `tell(message)`
        sends a message to every other rank, which runs its own part of the connector
        (engine/tp_rank.py takes the connector's messages). A connector that cannot span ranks
        refuses with ValueError, naming why."""
        raise ValueError(f"{type(self).__name__} does not take a tensor-parallel engine")

    # ------------------------------------------------------------------ scheduler side
    def num_remote_tokens(self, seq) -> int:
        """Prompt tokens of `seq` whose KV arrives from elsewhere instead of being computed here
        (0: compute them), past the `seq.num_computed_tokens` this engine already holds. Asked
        once, when the request is added (nothing held yet); the scheduler may then find a prefix
        of the prompt in its own prefix cache, which `on_blocks_allocated` sees."""
        return 0

    def on_blocks_allocated(self, seq, block_ids: list[int]) -> None:
        """The scheduler reserved `block_ids` (the whole table) for a request with remote tokens.
        The first `seq.num_computed_tokens` tokens' blocks (whole blocks) already hold a cached
        prefix; the blocks after them, up to ceil(prompt_len / block size), receive the KV. Raise
        ValueError to refuse (the scheduler then frees the blocks and the request is not added)."""

    def build_step(self, batch) -> None:
        """Before a forward: `batch` (the step's rows, engine/step_contract.py `StepRow`: request,
        span, block ids) is what runs.
        A request whose prompt completes in this step and that has a `RemoteDecode` starts
        sending here. A transfer that cannot begin is reported failed by `get_finished`."""

    def request_finished(self, seq) -> bool:
        """`seq` finished or was aborted here. True: the connector still reads or writes its
        blocks; the engine holds them (KV_HELD) until `get_finished` reports the request.
        False: free them now (a transfer not yet begun is withdrawn)."""
        return False

    # ------------------------------------------------------------------ worker side
    def start_load_kv(self) -> None:
        """At the start of a forward: begin any load the step needs (layerwise receivers that
        receive in their own threads need nothing here)."""

    def wait_for_layer_load(self, layer: int) -> None:
        """Before layer `layer`'s attention: block until that layer's incoming KV is in place."""

    def save_kv_layer(self, layer: int) -> None:
        """Right after layer `layer` wrote its KV: post that layer of this step's sends
        (non-blocking; the bytes travel while the next layer computes)."""

    def wait_for_save(self) -> None:
        """At the end of a forward: block until this step's saves no longer need the forward's
        temporaries (the blocks themselves stay held until `get_finished`)."""

    def abort_step(self, reason: str) -> None:
        """The forward raised midway: fail this step's transfers (reported by `get_finished`)."""

    @abstractmethod
    def get_finished(self) -> tuple[list[FinishedTransfer], list[FinishedTransfer]]:
        """(finished sending, finished receiving) since the last call; each request once. A
        receiving entry without error means the KV is in its blocks and `first_token` is set."""

    def has_pending(self) -> bool:
        """Transfers are in flight (the owner polls `get_finished` promptly while True)."""
        return False

    def close(self) -> None:
        """Stop every thread and pair; pending transfers fail. Final."""
