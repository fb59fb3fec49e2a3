"""`LayerwiseSendConnector`: the prefill role of the engine's KV connector, over `KVSender`.

Scheduler side: `build_step` opens one batch with every request whose prompt completes in the
step and that carries a `RemoteDecode` (source blocks from the step's block tables, the prompt's
blocks only, less the leading ones the decode side holds already: `RemoteDecode.num_cached_tokens`,
its prefix cache); `request_finished` keeps a request's blocks while its transfer may still read
them. Worker side: `save_kv_layer(i)` posts layer i (it travels while layer i+1 computes);
`get_finished` reports sends that D acknowledged, failed, or could not begin, and counts them
in `counters` (bytes of the acknowledged ones: whole blocks, every layer's K and V of every KV
head the decode side's ranks hold — what all of this instance's ranks sent together —; and the
bytes the decode side's cache spared them).
Pairs: `join(peer, rdzv)` builds (or keeps) the pair to a decode peer; a rendezvous older than
the current pair's generation is refused (`StalePairError`).
Tensor parallelism (`span_ranks`): the other ranks of the instance hold their own `KVSender`s
(engine/tp_rank.py applies them: rank_part.py); each join, each batch opened (before the forward that sends
it) and each abort is told to them, and they send their links' KV heads in the same forward.
"""
from __future__ import annotations

import logging

from epdserve.seams.kv_connector import FinishedTransfer, KVConnector, RemoteDecode
from epdserve.transfer.kv.config import KVTransferConfig
from epdserve.transfer.kv.links import held_heads
from epdserve.transfer.kv.messages import PairRendezvous
from epdserve.transfer.kv.pair_names import pair_generation
from epdserve.transfer.kv.rank_part import RankPart, rank_config
from epdserve.transfer.kv.sender import KVSender, SendRequest
from epdserve.transfer.kv.state import PairState, TransferCounters, TransferStatus

log = logging.getLogger(__name__)


class StalePairError(RuntimeError):
    """A request names a pair older than the one this side already uses for that peer."""


class LayerwiseSendConnector(KVConnector):
    def __init__(self, config: KVTransferConfig | None = None):
        self.config = config or KVTransferConfig()
        self.sender: KVSender | None = None
        self._block_size = 0
        self._head_bytes = 0  # one block of one KV head, every layer's K and V
        self._peer_block_bytes: dict[str, int] = {}  # decode peer -> one block of every head its ranks hold
        self.counters = TransferCounters()
        self._pair_names: dict[str, str] = {}  # decode peer -> current pair name
        self._inflight: dict[str, tuple[int, int]] = {}  # sends begun, not yet reported -> (blocks sent, skipped)
        self._refused: list[FinishedTransfer] = []
        self._share = None  # this rank's place in the instance's KV split (None: degree 1)
        self._tell = None  # sends a message to the instance's other ranks

    def span_ranks(self, share, tell) -> None:
        self._share, self._tell = share, tell

    def register_kv_cache(self, cache, platform) -> None:
        self.sender = KVSender(cache, platform, self.config, self._share)
        if self._tell is not None:
            self._tell(("part", RankPart))
            self._tell(("setup", "send", self._share.num_kv_heads, self._share.degree, rank_config(self.config)))
        self._block_size = cache.spec.block_size
        self._head_bytes = cache.spec.bytes_per_block() // cache.spec.num_kv_heads

    # ------------------------------------------------------------------ pairs (the worker's calls)
    def join(self, peer: str, rdzv: PairRendezvous) -> None:
        """Use the pair `rdzv` names for `peer` (connecting if it is new); StalePairError if older."""
        current = self._pair_names.get(peer)
        if current == rdzv.pair_name:
            return
        state = self.sender.pair_state(peer)
        if current is not None and state in (PairState.READY, PairState.CONNECTING) \
                and pair_generation(rdzv.pair_name) < pair_generation(current):
            raise StalePairError(f"stale KV pair {rdzv.pair_name!r} (current {current!r})")
        self.sender.connect(peer, rdzv)
        self._peer_block_bytes[peer] = self._head_bytes * held_heads(self.sender.share.num_kv_heads, rdzv.d_degree)
        if self._tell is not None:
            self._tell(("connect", peer, rdzv))
        self._pair_names[peer] = rdzv.pair_name

    def pair_state(self, peer: str) -> PairState | None:
        return self.sender.pair_state(peer)

    def status(self, request_id: str) -> TransferStatus | None:
        return self.sender.status(request_id)

    # ------------------------------------------------------------------ scheduler side
    def build_step(self, batch) -> None:
        reqs, skipped = [], {}
        for item in batch:
            seq, dest = item.seq, item.seq.handoff.kv_transfer
            if not isinstance(dest, RemoteDecode) or item.end != seq.prompt_len:
                continue
            n, cached = -(-seq.prompt_len // self._block_size), dest.num_cached_tokens
            if cached % self._block_size or not 0 <= cached < seq.prompt_len or len(dest.dst_block_ids) != n:
                self._refused.append(FinishedTransfer(
                    seq.request_id, f"refused: the decode side's reservation ({len(dest.dst_block_ids)} blocks, "
                                    f"{cached} cached tokens) does not fit a {seq.prompt_len}-token prompt"))
                continue
            skip = cached // self._block_size
            reqs.append(SendRequest(seq.request_id, dest.peer, tuple(item.block_ids[skip:n]),
                                    tuple(dest.dst_block_ids[skip:]), seq.prompt_len - cached))
            skipped[seq.request_id] = skip
        if not reqs:
            return
        try:
            opened = self.sender.begin_batch(reqs)
            if self._tell is not None and opened:
                self._tell(("follow", opened))  # before the forward that sends it
        except (ValueError, RuntimeError) as e:  # a bad reservation: those requests fail, the forward goes on
            log.warning("KV transfer of %d request(s) refused: %s", len(reqs), e)
            self._refused.extend(FinishedTransfer(r.request_id, f"refused: {e}") for r in reqs)
            return
        self._inflight.update((r.request_id, (len(r.dst_block_ids), skipped[r.request_id])) for r in reqs)

    def request_finished(self, seq) -> bool:
        return seq.request_id in self._inflight

    # ------------------------------------------------------------------ worker side
    def save_kv_layer(self, layer: int) -> None:
        self.sender.save_layer(layer)

    def abort_step(self, reason: str) -> None:
        self.sender.abort_batch(reason)
        if self._tell is not None:
            self._tell(("abort", reason))

    def get_finished(self) -> tuple[list[FinishedTransfer], list[FinishedTransfer]]:
        sent, self._refused = self._refused, []
        self.counters.failures += len(sent)
        for st in self.sender.pop_finished():
            blocks, skip = self._inflight.pop(st.request_id, (0, 0))
            if st.error:
                log.warning("KV transfer of %s to %s failed: %s", st.request_id, st.peer, st.error)
                self.counters.failures += 1
            else:
                block_bytes = self._peer_block_bytes.get(st.peer, 0)  # what every rank sent, together
                self.counters.bytes += blocks * block_bytes
                self.counters.bytes_skipped += skip * block_bytes
            sent.append(FinishedTransfer(st.request_id, st.error))
        self.counters.leaked_communicators = self.sender.leaked_communicators
        return sent, []

    def has_pending(self) -> bool:
        return bool(self._inflight)

    def close(self) -> None:
        if self.sender is not None:
            self.sender.close()

