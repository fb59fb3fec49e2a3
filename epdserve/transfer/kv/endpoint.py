"""`PairEndpoint`: what KVSender (a prefill rank) and KVReceiver (a decode rank) share — one
channel per peer instance, and this rank's place in its instance's KV split (`KvShare`).

A channel owns one `PairConnection` and the thread that waits on it. Endpoints connect,
replace and disconnect peers, report pair states and stop every thread on `close()`.
Channel threads must be stopped before the interpreter finalizes (a daemon thread returning
from a torch wait during finalization aborts the process): `close()` does it, and a finalizer
does it at exit for an endpoint nobody closed.
"""
from __future__ import annotations

import threading
import weakref

from epdserve.transfer.kv.config import KVTransferConfig
from epdserve.transfer.kv.links import KvShare, group_peers, hop_links
from epdserve.transfer.kv.messages import PairRendezvous
from epdserve.transfer.kv.pair import PairConnection
from epdserve.transfer.kv.state import PairState


class PairEndpoint:
    PREFILL: bool  # the prefill side (sender) or the decode side (receiver)
    SIDE: str

    def __init__(self, cache, platform, config: KVTransferConfig | None = None, share: KvShare | None = None):
        """`share`: this rank's place in its instance's split (None: an instance of degree 1,
        whose cache holds every KV head)."""
        self.cache = cache
        self.share = share or KvShare(cache.spec.num_kv_heads)
        if cache.spec.num_kv_heads != len(self.share.heads):
            raise ValueError(f"rank {self.share.rank} of {self.share.degree} holds {len(self.share.heads)} of "
                             f"{self.share.num_kv_heads} KV heads, its cache {cache.spec.num_kv_heads}")
        self.platform = platform
        self.config = config or KVTransferConfig()
        self.device = cache.keys[0].device
        self._lock = threading.Lock()
        self._channels: dict = {}
        self.leaked_communicators = 0  # pairs whose teardown left an operation running (`PairConnection.drain`)
        self._closer = weakref.finalize(self, _stop_channels, self._channels, self._lock, self.config.timeout_s + 1.0)

    def _new_channel(self, peer: str, pair: PairConnection):
        """The side-specific channel (it starts its own thread)."""
        raise NotImplementedError

    def connect(self, peer: str, rdzv: PairRendezvous) -> PairConnection:
        """Start building the pair to `peer` (replacing a previous one); returns at once."""
        if not self._closer.alive:
            raise RuntimeError(f"{type(self).__name__} is closed")
        degree = rdzv.p_degree if self.PREFILL else rdzv.d_degree
        if rdzv.prefill_side != self.PREFILL or (rdzv.local_rank, degree) != (self.share.rank, self.share.degree):
            raise ValueError(f"the {self.SIDE} side's rank {self.share.rank} of {self.share.degree} cannot join "
                             f"a pair as {rdzv}")
        self.disconnect(peer)
        peers = group_peers(rdzv.p_degree, rdzv.d_degree, self.links(rdzv), rdzv.rank)
        pair = PairConnection(rdzv, self.platform, self.config, self.device, on_leak=self._count_leak, peers=peers)
        with self._lock:
            self._channels[peer] = self._new_channel(peer, pair)
        return pair

    def links(self, rdzv: PairRendezvous):
        """Every link of the pair `rdzv` names (links.py)."""
        return hop_links(self.share.num_kv_heads, rdzv.p_degree, rdzv.d_degree)

    def disconnect(self, peer: str) -> None:
        """Stop the peer's channel: its in-flight transfers fail, its thread drains and ends."""
        with self._lock:
            ch = self._channels.pop(peer, None)
        if ch is not None:
            ch.stop()
            ch.thread.join(self.config.timeout_s + 1.0)

    def pair_state(self, peer: str) -> PairState | None:
        ch = self._channels.get(peer)
        return ch.pair.state if ch else None

    def pair_error(self, peer: str) -> str | None:
        ch = self._channels.get(peer)
        return ch.pair.error if ch else None

    def _count_leak(self) -> None:
        with self._lock:
            self.leaked_communicators += 1

    def close(self) -> None:
        """Disconnect every peer (pending transfers fail) and stop the threads; final."""
        self._closer()


def _stop_channels(channels: dict, lock: threading.Lock, join_s: float) -> None:
    with lock:
        chans = list(channels.values())
        channels.clear()
    for ch in chans:
        ch.stop()
    for ch in chans:
        ch.thread.join(join_s)
