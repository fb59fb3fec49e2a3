"""`RendezvousServer`: the TCP store a prefill instance hosts for the pairs it serves.

One per prefill process, on a free port. Each P–D pair joins it under its own prefix (the pair
name), so one server serves any number of decode peers and any number of rebuilds.
"""
from __future__ import annotations

from datetime import timedelta

from torch.distributed import TCPStore

from epdserve.transfer.kv.messages import SENDER_RANK, PairRendezvous


class RendezvousServer:
    """host: the address decode instances reach this process at (the store listens on all
    interfaces); port 0 picks a free port (read it back from `.port`)."""

    def __init__(self, host: str = "127.0.0.1", port: int = 0, timeout_s: float = 60.0):
        self.host = host
        self._store = TCPStore(host, port, None, True, timeout=timedelta(seconds=timeout_s), wait_for_workers=False)
        self.port = int(self._store.port)

    def rendezvous(self, pair_name: str, rank: int = SENDER_RANK) -> PairRendezvous:
        return PairRendezvous(self.host, self.port, pair_name, rank)

    def close(self) -> None:
        self._store = None
