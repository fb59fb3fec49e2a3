"""The shared-memory all-reduce of CPU tensor-parallel ranks (engine/tp/shm_reduce.py), between
real processes: every call's sum is exact on both ranks, also when rank 1 sums only after rank 0
has written its next call (the two generations of slots reused safely; rank 1 is held back by
waiting for that state), a tensor over the capacity goes through the gloo group,
and a rank that is gone fails the other's wait with RankFailure instead of hanging it."""
from __future__ import annotations

import multiprocessing as mp
import os
from datetime import timedelta

import pytest
import torch

from epdserve.engine.tp import shm_reduce
from epdserve.engine.tp.failure import RankFailure
from epdserve.engine.tp.group import all_reduce, loopback_store, make_group
from epdserve.platform import get_platform
from tests.harness import wait_until

pytestmark = pytest.mark.skipif(not shm_reduce.usable(), reason="the shared-memory path runs on x86-64 only")

CAPACITY = 4096
SIZES = [1, 7, 512, CAPACITY // 4, CAPACITY // 4 + 1, 5000]  # the last two: over the capacity (fp32)
CALLS = 60


def _contribution(rank: int, call: int, n: int) -> torch.Tensor:
    return torch.arange(n, dtype=torch.float32) * (rank + 1) + call


def _fits(call: int) -> bool:
    return SIZES[call % len(SIZES)] * 4 <= CAPACITY


class _Behind(shm_reduce.ShmReduce):
    """Rank 1, made to run behind: on the calls marked `hold`, once every rank has arrived it
    waits, before summing, until rank 0 has written its next call's slot and flag — the moment a
    reused slot would be overwritten under its reader."""

    hold = False

    def _wait(self, flags, call):
        super()._wait(flags, call)
        if self.hold:
            wait_until(lambda: any(f[0] >= call + 1 for f in self._flags), 30, "rank 0 in its next call")


def _peer(path: str, port: int, results) -> None:
    from torch.distributed import TCPStore

    store = TCPStore("127.0.0.1", port, 2, False, timeout=timedelta(seconds=30))
    pg = make_group(get_platform("cpu"), store, 1, 2, 30)
    reduce = _Behind(path, 1, 2, CAPACITY, lambda t: all_reduce(pg, t), 30)
    ok = True
    for call in range(CALLS):
        n = SIZES[call % len(SIZES)]
        t = _contribution(1, call, n)
        # behind now and then: only where rank 0's next call also goes through the shared memory
        reduce.hold = call % 3 == 0 and call + 1 < CALLS and _fits(call + 1)
        reduce(t)
        ok &= torch.equal(t, _contribution(0, call, n) + _contribution(1, call, n))
    results.put(ok)


def test_every_sum_is_exact_on_both_ranks_and_a_gone_rank_fails_the_wait():
    path = shm_reduce.create_file(2, CAPACITY)
    store = loopback_store(2)
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    peer = ctx.Process(target=_peer, args=(path, store.port, results))
    peer.start()
    try:
        pg = make_group(get_platform("cpu"), store, 0, 2, 30)
        fell_back = []

        def fallback(t):
            fell_back.append(t.numel())
            all_reduce(pg, t)

        reduce = shm_reduce.ShmReduce(path, 0, 2, CAPACITY, fallback, 30, alive=peer.is_alive)
        for call in range(CALLS):
            n = SIZES[call % len(SIZES)]
            t = _contribution(0, call, n)
            reduce(t)
            assert torch.equal(t, _contribution(0, call, n) + _contribution(1, call, n)), (call, n)
        assert results.get(timeout=60) is True  # rank 1 got the same sums
        assert set(fell_back) == {CAPACITY // 4 + 1, 5000}  # only what does not fit went through gloo
        peer.join(30)
        with pytest.raises(RankFailure, match=r"rank\(s\) \[1\] did not arrive \(gone\)"):  # alive(), not the timeout
            reduce(torch.ones(4))
    finally:
        if peer.is_alive():
            peer.kill()
        if os.path.exists(path):
            os.unlink(path)
