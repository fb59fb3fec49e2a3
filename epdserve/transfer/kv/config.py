"""`KVTransferConfig`: the timeouts and polling period of the P→D KV hop, validated on construction,
how its pairs are reached (`PairNetwork`) and which hop carries their bytes (device or host-staged)."""
from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from epdserve.transfer.kv.host_hop import HOPS

if TYPE_CHECKING:
    from epdserve.transfer.kv.network import PairNetwork


@dataclass(frozen=True)
class KVTransferConfig:
    """timeout_s: the longest wait for any one posted message (a stalled peer fails the transfer
    after this; it must exceed one layer's compute time on P).
    bootstrap_timeout_s: D side, from `expect()` to the batch header naming the request.
    connect_timeout_s: building a pair's process group (both sides must arrive within it).
    poll_interval_s: D side, how often the header store is checked while nothing is expected from
    the peer (a header may still come, for a request D let go); while a transfer is expected, D
    waits on the store for its header instead (one call returns as soon as it is there).
    network: how pairs reach the pair store and which interface their sockets bind
    (`PairNetwork`; None: plaintext to the store, the backend's default interface).
    hop: "device" (the platform's backend straight from and into the KV blocks: gloo, NCCL,
    HCCL) or "host" (gloo between host buffers, each message staged through host memory:
    `host_hop.py`; for a P and a D on one accelerator, where NCCL cannot pair them). Both sides
    of a pair must use the same hop.
    max_pair_rebuilds / pair_rebuild_window_s: D side, at most this many rebuilds of the pair with
    one prefill peer within the window; beyond it the peer's new transfers fail (retryable: the
    scheduler reroutes) until the oldest rebuild leaves the window. Each pair that broke with an
    operation still running may leave an HCCL communicator behind (HcclCommDestroy returned
    HCCL_E_AGAIN: `PairConnection.drain`), so a peer that keeps breaking its pairs must not
    exhaust HCCL's resources. The instance flags: --kv-pair-rebuilds, --kv-pair-rebuild-window-s.
    """

    timeout_s: float = 30.0
    bootstrap_timeout_s: float = 120.0
    connect_timeout_s: float = 60.0
    poll_interval_s: float = 0.02
    network: PairNetwork | None = None
    hop: str = "device"
    max_pair_rebuilds: int = 8
    pair_rebuild_window_s: float = 600.0

    def __post_init__(self):
        if self.hop not in HOPS:
            raise ValueError(f"KVTransferConfig.hop must be one of {', '.join(HOPS)}, got {self.hop!r}")
        if isinstance(self.max_pair_rebuilds, bool) or not isinstance(self.max_pair_rebuilds, int) \
                or self.max_pair_rebuilds < 0:
            raise ValueError(f"KVTransferConfig.max_pair_rebuilds must be an integer >= 0, got {self.max_pair_rebuilds!r}")
        for name in ("timeout_s", "bootstrap_timeout_s", "connect_timeout_s", "poll_interval_s", "pair_rebuild_window_s"):
            value = getattr(self, name)
            if not isinstance(value, (int, float)) or value <= 0:
                raise ValueError(f"KVTransferConfig.{name} must be a positive number of seconds, got {value!r}")
