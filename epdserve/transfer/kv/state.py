"""Transfer and pair states: the small enums the engine loop polls, and one request's status."""
from __future__ import annotations

import enum
from dataclasses import dataclass


class TransferState(enum.Enum):
    BOOTSTRAPPING = "bootstrapping"
    TRANSFERRING = "transferring"
    DONE = "done"
    FAILED = "failed"

    @property
    def finished(self) -> bool:
        return self in (TransferState.DONE, TransferState.FAILED)


class PairState(enum.Enum):
    CONNECTING = "connecting"  # process group being built (rendezvous in a background thread)
    READY = "ready"
    BROKEN = "broken"  # peer died, stalled or never came; rebuild with a new pair name
    CLOSED = "closed"  # closed by us


@dataclass(frozen=True)
class TransferStatus:
    """A snapshot of one request's transfer (safe to hand to another thread)."""

    request_id: str
    peer: str
    state: TransferState
    layers_done: int
    num_layers: int
    error: str | None = None
