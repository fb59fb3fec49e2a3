"""When a dead child of `epdserve launch` is started again: capped exponential backoff, and the
crash loop after which it is not.

`RestartPolicy` holds the numbers (launch's --restart-* options). `RestartSchedule` is one
child's state: `exited(now)` answers the delay before its next start, or None once it is in a
crash loop — more than `max_restarts` exits in a row, each within `stable_after_s` of its
start (a child that ran that long starts a fresh count). The n-th restart in a row waits
`min(max_backoff_s, first_backoff_s * 2**(n-1))`. Pure bookkeeping: the caller owns the clock
and the processes.
"""
from __future__ import annotations

from dataclasses import dataclass

# An instance that stopped itself to be restarted (EX_TEMPFAIL): KV blocks held by a stuck receive
# with no bound (InstanceHost.check_restart). Restarted like any exit; the log says why.
RESTART_EXIT_CODE = 75


@dataclass(frozen=True)
class RestartPolicy:
    first_backoff_s: float = 0.5
    max_backoff_s: float = 10.0
    max_restarts: int = 5  # exits in a row (each soon after its start) before giving up
    stable_after_s: float = 60.0  # a child that ran this long is healthy again: its count restarts

    def __post_init__(self):
        if self.first_backoff_s < 0 or self.max_backoff_s < self.first_backoff_s:
            raise ValueError("restart backoff: need 0 <= first_backoff_s <= max_backoff_s")
        if self.max_restarts < 0 or self.stable_after_s <= 0:
            raise ValueError("restart policy: max_restarts must be >= 0 and stable_after_s > 0")


class RestartSchedule:
    def __init__(self, policy: RestartPolicy, started_at: float):
        self.policy = policy
        self.started_at = started_at
        self.failures = 0  # exits in a row, each within stable_after_s of its start
        self.restarts = 0  # starts after the first, in all
        self.due: float | None = None  # when the next start is due (None: running, or given up)
        self.gave_up = False

    def exited(self, now: float) -> float | None:
        """The child was seen dead at `now`: the delay before its restart, or None (crash loop)."""
        p = self.policy
        if now - self.started_at >= p.stable_after_s:
            self.failures = 0
        self.failures += 1
        if self.failures > p.max_restarts:
            self.gave_up = True
            self.due = None
            return None
        delay = min(p.max_backoff_s, p.first_backoff_s * 2 ** (self.failures - 1))
        self.due = now + delay
        return delay

    def is_due(self, now: float) -> bool:
        return self.due is not None and now >= self.due

    def started(self, now: float) -> None:
        self.started_at = now
        self.due = None
        self.restarts += 1
