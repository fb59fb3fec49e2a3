"""The scheduler's preprocessing threads shared fairly by tenants (scheduler/fair_pool.py), on a
real thread pool: while one thread is held, bob's three jobs and then alice's one queue; as the
thread frees, alice's runs before bob's second and third; a tenant alone runs in arrival order; a
job cancelled while queued (or just after a thread was handed to it) loses no thread."""
from __future__ import annotations

import asyncio
import threading
from concurrent.futures import ThreadPoolExecutor

from epdserve.scheduler.fair_pool import FairPool


def _job(ran: list, name: str, gate: threading.Event | None = None) -> str:
    if gate is not None:
        assert gate.wait(30)
    ran.append(name)
    return name


async def _until(cond) -> None:
    for _ in range(10_000):
        if cond():
            return
        await asyncio.sleep(0)  # the event loop's turn: the state is set by coroutines on it
    raise AssertionError("state never reached")


async def _one_thread_held(tenant: str, name: str):
    """A one-thread pool whose thread runs `name` until the returned event is set."""
    pool = ThreadPoolExecutor(1)
    fair, ran, hold = FairPool(pool, 1), [], threading.Event()
    first = asyncio.create_task(fair.run(tenant, _job, ran, name, hold))
    await _until(lambda: fair._free == 0)
    return pool, fair, ran, hold, first


def test_a_freed_thread_goes_to_the_tenant_served_least_recently():
    async def main():
        pool, fair, ran, hold, first = await _one_thread_held("bob", "b0")
        tasks = [asyncio.create_task(fair.run(t, _job, ran, n)) for t, n in
                 (("bob", "b1"), ("bob", "b2"), ("bob", "b3"), ("alice", "a0"), ("alice", "a1"))]
        await _until(lambda: fair.queued == 5)
        hold.set()
        assert await first == "b0"
        assert [await t for t in tasks] == ["b1", "b2", "b3", "a0", "a1"]  # results to their callers
        pool.shutdown()
        return ran

    # alice (never served) first; then bob and alice alternate while both wait
    assert asyncio.run(main()) == ["b0", "a0", "b1", "a1", "b2", "b3"]


def test_one_tenant_runs_in_arrival_order_and_a_cancelled_waiter_loses_no_thread():
    async def main():
        pool, fair, ran, hold, first = await _one_thread_held("", "r0")
        gone = asyncio.create_task(fair.run("", _job, ran, "gone"))
        rest = [asyncio.create_task(fair.run("", _job, ran, f"r{i}")) for i in (1, 2)]
        await _until(lambda: fair.queued == 3)
        gone.cancel()
        await _until(lambda: fair.queued == 2)
        hold.set()
        await first
        for t in rest:
            await t
        # a thread handed to a waiter cancelled before it ran is passed on
        hold2 = threading.Event()
        busy = asyncio.create_task(fair.run("", _job, ran, "r3", hold2))
        await _until(lambda: fair._free == 0)
        late = asyncio.create_task(fair.run("", _job, ran, "late"))
        after = asyncio.create_task(fair.run("", _job, ran, "r4"))
        await _until(lambda: fair.queued == 2)
        hold2.set()
        await busy
        late.cancel()  # its gate is resolved by now or is about to be: either way the thread moves on
        assert await after == "r4"
        await asyncio.gather(late, return_exceptions=True)
        pool.shutdown()
        return ran, fair._free

    ran, free = asyncio.run(main())
    assert [r for r in ran if r != "late"] == ["r0", "r1", "r2", "r3", "r4"] and free == 1
