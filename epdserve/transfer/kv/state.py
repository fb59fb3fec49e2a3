"""Transfer and pair states: the small enums the engine loop polls, one request's status, and a
connector's running totals (`TransferCounters`: bytes moved, and bytes a prefix cache spared)."""
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


@dataclass
class TransferCounters:
    """A connector's totals since start: KV bytes moved by finished transfers and failed transfers.
    Owned by the connector, touched only on the engine's loop thread (which also reads them for
    the instance's `Load`)."""

    bytes: int = 0
    failures: int = 0
    bytes_skipped: int = 0  # KV of prompt blocks the decode side held already (its prefix cache): not sent
    leaked_communicators: int = 0  # pairs torn down with an operation still running (HCCL: destroy returned E_AGAIN)
