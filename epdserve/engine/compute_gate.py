"""The engine's compute gate: what an engine asks before each compute step, and what it tells.

An engine wraps every compute step in `gate.hold(kind)` — "E" around a vision-encoder batch,
"D" around a model step that decodes at least one request, "P" around one that only prefills.
By default (`NO_GATE`) that does nothing. A stage worker co-located under the `slo` policy on
CPU installs a `LeaseGate` (instance/core_lease.py), which takes the machine's cores for the
step from the lease arbiter. The engine knows nothing of leases; the gate nothing of engines.
"""
from __future__ import annotations

from contextlib import nullcontext
from typing import Protocol


class ComputeGate(Protocol):
    def hold(self, kind: str): ...


class _NoGate:
    def hold(self, kind: str):
        return nullcontext()


NO_GATE = _NoGate()


def batch_kind(batch) -> str:
    """"D" if the scheduled batch decodes any request, else "P" (prefill only)."""
    return "D" if any(not item.seq.in_prefill for item in batch) else "P"


def hold_step(gate: ComputeGate, batch):
    """`gate.hold` around one model step over `batch`; without a gate, the batch is not even looked at."""
    return nullcontext() if gate is NO_GATE else gate.hold(batch_kind(batch))
