"""`FairPool`: the scheduler's preprocessing threads (tokenizing prompts, decoding media, keying
uploads), shared by tenants fairly instead of first come, first served.

At most `workers` jobs run at once on the thread pool. Past that, a job waits in its tenant's
queue; each freed thread goes to the queued job of the tenant served least recently (never
served: first), so one tenant's flood of image requests or uploads queues behind itself while
another tenant's request takes the next free thread. A tenant alone is served in arrival order.
Everything but the job itself runs on the event loop's thread (no lock); a waiter cancelled while
queued leaves its queue, and one cancelled just after a thread was handed to it passes the thread
on, so no thread is ever lost.
"""
from __future__ import annotations

import asyncio
from collections import deque
from collections.abc import Callable
from concurrent.futures import Executor

from epdserve.engine.turns import Turns


class FairPool:
    def __init__(self, pool: Executor, workers: int):
        self._pool = pool
        self._free = workers
        self._queued: dict[str, deque[asyncio.Future]] = {}  # tenant -> its waiting jobs' gates
        self._turns = Turns()  # tenants by when a job of theirs last took a thread

    @property
    def queued(self) -> int:
        return sum(len(q) for q in self._queued.values())

    async def run(self, tenant: str, fn: Callable, *args):
        """`fn(*args)` on a pool thread, once `tenant`'s turn comes; its result."""
        loop = asyncio.get_running_loop()
        if self._free > 0 and not self._queued:
            self._free -= 1
        else:
            gate = loop.create_future()
            self._queued.setdefault(tenant, deque()).append(gate)
            try:
                await gate  # resolved: a thread was handed to this job
            except asyncio.CancelledError:
                if gate.done() and not gate.cancelled():
                    self._release()  # handed a thread it will not use: pass it on
                else:
                    self._forget(tenant, gate)
                raise
        self._turns.served(tenant)
        try:
            return await loop.run_in_executor(self._pool, fn, *args)
        finally:
            self._release()

    def _forget(self, tenant: str, gate: asyncio.Future) -> None:
        q = self._queued.get(tenant)
        if q is not None and gate in q:
            q.remove(gate)
            if not q:
                del self._queued[tenant]

    def _release(self) -> None:
        """A thread is free: the least recently served tenant's next job takes it, else it idles."""
        while self._queued:
            tenant = self._turns.next(self._queued)
            q = self._queued[tenant]
            gate = q.popleft()
            if not q:
                del self._queued[tenant]
            if not gate.done():
                self._turns.served(tenant)
                gate.set_result(None)
                return
        self._free += 1
