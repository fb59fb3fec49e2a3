"""`Turns`: whose turn is next among several parties (tenants) that take turns at one resource —
the party served least recently, one never served first. The engine's admission
(engine/fair_share.py, engine/scheduler.py), its grammar compiles (engine/grammar_compile.py)
and the scheduler's preprocessing threads (scheduler/fair_pool.py) take turns this way. No
clock: a counter orders the services."""
from __future__ import annotations

import itertools
from collections.abc import Hashable, Iterable


class Turns:
    def __init__(self):
        self.last: dict[Hashable, int] = {}  # party -> the number of its latest service
        self._count = itertools.count()

    def served(self, party: Hashable) -> None:
        self.last[party] = next(self._count)

    def order(self, party: Hashable) -> int:
        """Sorts the party served least recently first (-1: never served)."""
        return self.last.get(party, -1)

    def next(self, parties: Iterable[Hashable]) -> Hashable:
        """Of `parties` (non-empty), the one whose turn it is; ties in the order given."""
        return min(parties, key=self.order)
