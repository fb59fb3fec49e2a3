"""`KVTransferConfig`: the timeouts and polling period of the P→D KV hop, validated on construction,
how its pairs are reached (`PairNetwork`) and which hop carries their bytes (device or host-staged).

Its `setting(...)` fields are declared here once, flags included (epdserve/settings.py): the
instance offers them `same_as` these (`--kv-timeout-s`, `--kv-hop`, ...) and builds its pairs'
config from them (`InstanceConfig.kv_transfer`)."""
from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from epdserve.settings import check_settings, setting
if TYPE_CHECKING:  # network.py imports torch.distributed; `--help` reads only the settings' types
    from epdserve.transfer.kv.network import PairNetwork

HOPS = ("device", "host")  # what may carry a pair's bytes (host_hop.py stages the second); no torch here: `--help` reads it

KV_HOP_HELP = (
    "how P->D KV bytes travel: device = the device's own backend straight between KV blocks (gloo on CPU, NCCL on "
    "CUDA, HCCL on NPU); host = gloo between host buffers, each layer's blocks copied device -> pinned host -> "
    "host -> device (for a P and a D on one accelerator: NCCL refuses two ranks on one device); a P and its D must "
    "use the same. auto: device, unless `epdserve launch` puts a P and a D on the same accelerator, when it passes "
    "host to every instance")


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
    `host_hop.py`; for a P and a D on one accelerator, where NCCL cannot pair them); "auto" is
    "device" here (the launcher passes "host" where it is needed). Both sides of a pair must use
    the same hop.
    max_pair_rebuilds / pair_rebuild_window_s: D side, at most this many rebuilds of the pair with
    one prefill peer within the window; beyond it the peer's new transfers fail (retryable: the
    scheduler reroutes) until the oldest rebuild leaves the window. Each pair that broke with an
    operation still running may leave an HCCL communicator behind (HcclCommDestroy returned
    HCCL_E_AGAIN: `PairConnection.drain`), so a peer that keeps breaking its pairs must not
    exhaust HCCL's resources.
    """

    timeout_s: float = setting(30.0, flag="--kv-timeout-s", check=(">", 0),
                               help="a KV transfer that makes no progress this long fails its request")
    bootstrap_timeout_s: float = 120.0
    connect_timeout_s: float = setting(60.0, flag="--kv-connect-timeout-s", check=(">", 0),
                                       help="setting up a KV pair with a P or D gives up after this long")
    poll_interval_s: float = 0.02
    network: PairNetwork | None = None
    hop: str = setting("auto", flag="--kv-hop", choices=("auto", *HOPS), help=KV_HOP_HELP)
    max_pair_rebuilds: int = setting(
        8, flag="--kv-pair-rebuilds", check=(">=", 0),
        help="D: at most this many rebuilds of the KV pair with one P within --kv-pair-rebuild-window-s; "
             "beyond it requests from that P fail as retryable (rerouted): each pair that broke mid-transfer "
             "may leave an HCCL communicator behind")
    pair_rebuild_window_s: float = setting(600.0, flag="--kv-pair-rebuild-window-s", check=(">", 0),
                                           help="D: the window of --kv-pair-rebuilds, seconds")

    def __post_init__(self):
        if self.hop == "auto":  # the launcher resolves auto (host where a P and a D share an accelerator)
            object.__setattr__(self, "hop", "device")
        if isinstance(self.max_pair_rebuilds, bool) or not isinstance(self.max_pair_rebuilds, int):
            raise ValueError(f"KVTransferConfig.max_pair_rebuilds must be an integer >= 0, got {self.max_pair_rebuilds!r}")
        check_settings(self)  # the bounds and choices declared on the settings
        for name in ("bootstrap_timeout_s", "poll_interval_s"):  # not settings: no flag
            value = getattr(self, name)
            if not isinstance(value, (int, float)) or value <= 0:
                raise ValueError(f"KVTransferConfig.{name} must be a positive number of seconds, got {value!r}")
