"""`LayerwiseRecvConnector`: the decode role of the engine's KV connector, over `KVReceiver`.

A request with `RemotePrefill` has all of its prompt's KV (and the first token) made elsewhere:
`num_remote_tokens` says so, the scheduler reserves blocks for prompt + max_tokens, and
`on_blocks_allocated` tells the receiver to expect the KV into the prompt's blocks (it is
received by the pair's thread, straight into them). When the scheduler found a prefix of the
prompt in this engine's prefix cache (KV imported or decoded here for an earlier turn), those
whole blocks are already in place: only the blocks after them are expected, and
`cached_tokens` tells the prefill side (through the reservation) to send only those. The prefill side's first token and M-RoPE
delta arrive through the control plane: `set_first_token` (a request with n > 1 choices: the
first tokens of choices 1..n-1 too, `choice_tokens`; its KV crosses once for all of them). `get_finished` reports a request as
received once both are in (or failed), and counts it in `counters` (bytes received: whole
blocks received, every layer's K and V, over every rank; `bytes_skipped`: the cached blocks that did not travel;
failures: receives that failed, not requests aborted here). An
aborted request whose KV is still arriving is held (`request_finished` → True) until the
receiver is done with its blocks. A failed request whose receives outlived the pair's teardown
(HCCL: HcclCommDestroy returned E_AGAIN; `KVReceiver.quarantined`) is failed at once but its
blocks are held the same way, until those receives end or HCCL_EXEC_TIMEOUT passes
(`KVReceiver.pop_released`): the engine frees them only then.
Pairs: `pair_for(peer, host, port)` reuses the pair to a prefill peer, or builds the next
generation when the old one broke or the peer moved — at most `KVTransferConfig.max_pair_rebuilds`
rebuilds per peer within `pair_rebuild_window_s`; beyond that it raises `PairRebuildsExhausted`
(the decode worker fails the request as retryable: the scheduler reroutes it), since each pair
that broke mid-operation may have left an HCCL communicator behind (`counters.leaked_communicators`).
Tensor parallelism (`span_ranks`): the other ranks hold their own `KVReceiver`s
(engine/tp_rank.py); each pair built here is told to them, they join it and receive their KV
heads into their own caches, and this rank's receiver reports a request DONE only once every
rank has all of its heads (receiver.py).
"""
from __future__ import annotations

import logging
import time
from collections import deque
from dataclasses import dataclass

from epdserve.seams.kv_connector import FinishedTransfer, KVConnector, RemotePrefill
from epdserve.transfer.kv.config import KVTransferConfig
from epdserve.transfer.kv.links import held_heads
from epdserve.transfer.kv.messages import PairRendezvous
from epdserve.transfer.kv.pair_names import pair_name
from epdserve.transfer.kv.rank_part import RankPart, rank_config
from epdserve.transfer.kv.receiver import KVReceiver, RecvRequest
from epdserve.transfer.kv.state import PairState, TransferCounters, TransferState

log = logging.getLogger(__name__)


class PairRebuildsExhausted(RuntimeError):
    """The pair with this prefill peer was rebuilt too often lately; retry elsewhere or later."""


@dataclass
class _Incoming:
    block_ids: tuple[int, ...]  # every prompt block, the cached ones first
    skip: int = 0  # leading blocks already cached here: not received
    kv_done: bool = False
    first_token: int | None = None
    rope_delta: int = 0
    choice_tokens: tuple[int, ...] = ()  # n > 1: P's first tokens of choices 1..n-1
    aborted: bool = False  # the engine let go; report it once the receiver is done with the blocks
    quarantined: bool = False  # failed, but a receive that outlived its pair may still write the blocks


class LayerwiseRecvConnector(KVConnector):
    def __init__(self, instance_id: str, config: KVTransferConfig | None = None):
        self.instance_id = instance_id
        self.config = config or KVTransferConfig()
        self.receiver: KVReceiver | None = None
        self._block_size = 0
        self._block_bytes = 0  # one block, every layer's K and V
        self.counters = TransferCounters()
        self._pairs: dict[str, PairRendezvous] = {}  # prefill peer -> current pair (our rank 1)
        self._generations: dict[str, int] = {}
        self._rebuilds: dict[str, deque] = {}  # prefill peer -> monotonic times of its recent rebuilds
        self._capped: set[str] = set()  # peers refused since their last successful (re)build: logged once
        self._incoming: dict[str, _Incoming] = {}
        self._share = None  # this rank's place in the instance's KV split (None: degree 1)
        self._tell = None  # sends a message to the instance's other ranks

    def span_ranks(self, share, tell) -> None:
        self._share, self._tell = share, tell

    def register_kv_cache(self, cache, platform) -> None:
        self.receiver = KVReceiver(cache, platform, self.config, self._share)
        if self._tell is not None:
            self._tell(("part", RankPart))
            self._tell(("setup", "recv", self._share.num_kv_heads, self._share.degree, rank_config(self.config)))
        self._block_size = cache.spec.block_size
        share = self.receiver.share  # every rank's heads: what the instance received together
        self._block_bytes = cache.spec.bytes_per_block() // cache.spec.num_kv_heads * held_heads(share.num_kv_heads,
                                                                                                 share.degree)

    # ------------------------------------------------------------------ the worker's calls
    def pair_for(self, peer: str, host: str, port: int, p_degree: int = 1) -> PairRendezvous:
        """The pair to prefill peer `peer` whose rendezvous store is at host:port and whose
        tensor-parallel degree is `p_degree` (ours: D's rank 0, group rank `p_degree`)."""
        cur = self._pairs.get(peer)
        if cur is not None and (cur.host, cur.port, cur.p_degree) == (host, int(port), p_degree) \
                and self.receiver.pair_state(peer) in (PairState.CONNECTING, PairState.READY):
            return cur
        if cur is not None:
            self._count_rebuild(peer, cur)
        gen = self._generations.get(peer, -1) + 1
        self._generations[peer] = gen
        d_degree = self.receiver.share.degree
        rdzv = PairRendezvous(host, int(port), pair_name(peer, self.instance_id, gen), p_degree, p_degree, d_degree)
        self.receiver.connect(peer, rdzv)
        if self._tell is not None:
            self._tell(("connect", peer, rdzv))
        self._pairs[peer] = rdzv
        return rdzv

    def _count_rebuild(self, peer: str, old: PairRendezvous) -> None:
        """Count one rebuild of the pair with `peer`; PairRebuildsExhausted (nothing built) when
        `max_pair_rebuilds` were made within the last `pair_rebuild_window_s`."""
        cfg, now = self.config, time.monotonic()
        recent = self._rebuilds.setdefault(peer, deque())
        while recent and now - recent[0] >= cfg.pair_rebuild_window_s:
            recent.popleft()
        if len(recent) >= cfg.max_pair_rebuilds:
            wait_s = cfg.pair_rebuild_window_s - (now - recent[0]) if recent else cfg.pair_rebuild_window_s
            why = (f"the KV pair with prefill peer {peer!r} was rebuilt {len(recent)} times in the last "
                   f"{cfg.pair_rebuild_window_s:g} s (limit {cfg.max_pair_rebuilds}; last: "
                   f"{self.receiver.pair_error(peer) or 'broken'}); its transfers fail for {wait_s:.0f} s more, "
                   f"so that a peer breaking its pairs cannot exhaust communicator resources")
            if peer not in self._capped:
                self._capped.add(peer)
                log.warning("%s (%s -> %s:%d; %d communicators left behind so far)", why, old.pair_name, old.host,
                            old.port, self.receiver.leaked_communicators)
            raise PairRebuildsExhausted(why)
        self._capped.discard(peer)
        recent.append(now)

    def reserved_blocks(self, request_id: str) -> tuple[int, ...]:
        """The blocks holding the request's prompt KV, in order (for the prefill side): the first
        `cached_tokens(request_id) / block size` of them hold it already, the rest receive it."""
        return self._incoming[request_id].block_ids

    def cached_tokens(self, request_id: str) -> int:
        """Prompt tokens whose KV this engine held already (whole blocks): not to be sent."""
        return self._incoming[request_id].skip * self._block_size

    def set_first_token(self, request_id: str, token: int, rope_delta: int, choice_tokens=()) -> None:
        """The prefill side's first token (and, n > 1, its other choices' first tokens); KeyError if
        the request is not (any more) expected."""
        inc = self._incoming.get(request_id)
        if inc is None or inc.aborted:
            raise KeyError(request_id)
        inc.first_token, inc.rope_delta = int(token), int(rope_delta)
        inc.choice_tokens = tuple(int(t) for t in choice_tokens)

    # ------------------------------------------------------------------ scheduler side
    def num_remote_tokens(self, seq) -> int:
        return seq.prompt_len - seq.num_computed_tokens if isinstance(seq.handoff.kv_transfer, RemotePrefill) else 0

    def on_blocks_allocated(self, seq, block_ids: list[int]) -> None:
        bs, cached = self._block_size, seq.num_computed_tokens
        if cached % bs or cached >= seq.prompt_len:
            raise ValueError(f"{seq.request_id}: a cached prefix of {cached} tokens is not whole blocks "
                             f"short of the {seq.prompt_len}-token prompt")
        prompt_blocks, skip = tuple(block_ids[: -(-seq.prompt_len // bs)]), cached // bs
        self.receiver.expect(RecvRequest(seq.request_id, seq.handoff.kv_transfer.peer, prompt_blocks[skip:],
                                         seq.prompt_len - cached))
        self._incoming[seq.request_id] = _Incoming(prompt_blocks, skip)

    def request_finished(self, seq) -> bool:
        inc = self._incoming.get(seq.request_id)
        if inc is None:
            return False
        if not inc.quarantined and (inc.kv_done or self.receiver.cancel(seq.request_id)):
            del self._incoming[seq.request_id]
            return False
        inc.aborted = True  # KV may be arriving into the blocks
        return True

    # ------------------------------------------------------------------ worker side
    def get_finished(self) -> tuple[list[FinishedTransfer], list[FinishedTransfer]]:
        done: list[FinishedTransfer] = []
        # DONE means every receive of the request completed on the device (Platform.wait_work):
        # its KV is in the blocks, so no stream (and no other request) has to wait for it.
        for st in self.receiver.pop_finished():
            inc = self._incoming.get(st.request_id)
            if inc is None:
                continue
            if inc.aborted or st.error is not None or st.state is not TransferState.DONE:
                self.counters.failures += not inc.aborted
                if self.receiver.quarantined(st.request_id):  # fail the request now, hold its blocks
                    inc.quarantined = True
                    if not inc.aborted:
                        done.append(FinishedTransfer(st.request_id, st.error or st.state.value))
                    continue
                del self._incoming[st.request_id]
                done.append(FinishedTransfer(st.request_id, st.error or ("aborted" if inc.aborted else st.state.value)))
            else:
                inc.kv_done = True
                self.counters.bytes += (len(inc.block_ids) - inc.skip) * self._block_bytes
                self.counters.bytes_skipped += inc.skip * self._block_bytes
        for rid in self.receiver.pop_released():  # the held blocks may go back to the free list
            inc = self._incoming.pop(rid, None)
            if inc is not None:
                done.append(FinishedTransfer(rid, "stuck receive ended or timed out"))
        for rid, inc in list(self._incoming.items()):
            if inc.kv_done and inc.first_token is not None:
                del self._incoming[rid]
                done.append(FinishedTransfer(rid, None, inc.first_token, inc.rope_delta, inc.choice_tokens))
        self.counters.leaked_communicators = self.receiver.leaked_communicators
        return [], done

    def restart_reason(self) -> str | None:
        """Why the instance should be restarted (`KVReceiver.unbounded_quarantine`), or None."""
        return self.receiver.unbounded_quarantine() if self.receiver is not None else None

    def has_pending(self) -> bool:
        return bool(self._incoming)

    def close(self) -> None:
        if self.receiver is not None:
            self.receiver.close()
