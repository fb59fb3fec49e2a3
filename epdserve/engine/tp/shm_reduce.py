"""`ShmReduce`: the all-reduce of a tensor-parallel group whose ranks share one host's memory
(the CPU), through a shared-memory file instead of gloo's sockets.

Why: measured on this project's 2-core host, one gloo all-reduce of a decode step's hidden state
(512 floats) between two ranks on loopback takes ~0.5-0.8 ms; a TP decode step makes two per
layer. Through shared memory it is two copies and a sum.

Layout: two generations (a call uses generation `call % 2`), each with one slot per rank of
`capacity` bytes and one int64 flag per rank. Call i: a rank copies its tensor into its slot of
generation g, then sets its flag of g to i + 1; once every rank's flag of g reads i + 1, each rank
sums the slots in rank order (so every rank gets the same bits) into its tensor. A rank reaches
call i + 2 (generation g again) only after every rank set its flag for call i + 1, which each sets
only after it finished reading generation g in call i: two generations make the slots safe to
reuse with one wait per call. (x86 keeps stores in program order, so a flag is never seen before
the slot written before it; other CPUs would need a fence.)

A tensor larger than `capacity` goes through the fallback group (gloo). A rank waits for the
others spinning briefly, then yielding its core, then napping; past `timeout_s`, or as soon as
`alive()` says a rank is gone, it raises `RankFailure`. Used on x86 only (`usable`): elsewhere
stores may be seen out of order without fences, and the group stays on gloo. The file is created by rank 0 (mode 0600) and unlinked once
every rank has mapped it: nothing stays in /dev/shm, however the group ends.
"""
from __future__ import annotations

import mmap
import os
import tempfile
import time
from collections.abc import Callable

import numpy as np
import torch

from epdserve.engine.tp.failure import RankFailure

_SPIN = 2000  # flag reads before the waiting rank starts yielding its core
_NAP_AFTER_S, _NAP_S = 0.005, 0.0002  # past this wait it sleeps between reads
_ALIGN = 64


def usable() -> bool:
    """Whether this machine keeps stores in order (x86-64), which the flags rely on."""
    import platform

    return platform.machine().lower() in ("x86_64", "amd64")


def create_file(size: int, capacity: int) -> str:
    """Rank 0: a zeroed file for `size` ranks of `capacity` bytes (in /dev/shm where there is one)."""
    directory = "/dev/shm" if os.path.isdir("/dev/shm") else None
    fd, path = tempfile.mkstemp(prefix="epdserve-tp-", dir=directory)
    try:
        os.ftruncate(fd, _file_bytes(size, capacity))
    finally:
        os.close(fd)
    return path


def _file_bytes(size: int, capacity: int) -> int:
    return 2 * (size * capacity + _ALIGN)


class ShmReduce:
    def __init__(self, path: str, rank: int, size: int, capacity: int, fallback: Callable[[torch.Tensor], None],
                 timeout_s: float, alive: Callable[[], bool] = lambda: True):
        """Map the group's file (`create_file`); `fallback(t)` reduces what does not fit."""
        self.rank, self.size, self.capacity = rank, size, capacity
        self._fallback, self._timeout_s, self._alive = fallback, timeout_s, alive
        with open(path, "r+b") as f:
            self._mm = mmap.mmap(f.fileno(), _file_bytes(size, capacity))
        gen = size * capacity + _ALIGN
        self._flags = [np.ndarray((size,), np.int64, self._mm, g * gen) for g in range(2)]
        self._slots = [torch.frombuffer(self._mm, dtype=torch.uint8, count=size * capacity, offset=g * gen + _ALIGN)
                       .view(size, capacity) for g in range(2)]
        self._calls = 0

    def __call__(self, t: torch.Tensor) -> None:
        """Sum `t` over the group in place (every rank calls it with the same shape and dtype)."""
        nbytes = t.numel() * t.element_size()
        if nbytes > self.capacity or not t.is_contiguous():
            self._fallback(t)
            return
        g, call = self._calls % 2, self._calls + 1
        self._calls = call
        slots = self._slots[g][:, :nbytes].view(t.dtype).view(self.size, *t.shape)
        slots[self.rank].copy_(t)
        flags = self._flags[g]
        flags[self.rank] = call
        self._wait(flags, call)
        torch.sum(slots, dim=0, out=t) if self.size > 2 else torch.add(slots[0], slots[1], out=t)

    def _wait(self, flags: np.ndarray, call: int) -> None:
        spins, started = 0, None
        while (flags < call).any():
            spins += 1
            if spins < _SPIN:
                continue
            if spins % 256 == 0:
                now = time.monotonic()
                started = started or now
                if now - started > self._timeout_s or not self._alive():
                    missing = [r for r in range(self.size) if flags[r] < call]
                    raise RankFailure(f"tensor-parallel all-reduce: rank(s) {missing} did not arrive "
                                      f"({'gone' if now - started <= self._timeout_s else f'within {self._timeout_s:g} s'})")
                if now - started > _NAP_AFTER_S:  # a long wait: stop taking a core from the ranks that work
                    time.sleep(_NAP_S)
                    continue
            os.sched_yield()

    def close(self) -> None:
        self._slots = self._flags = []
        try:
            self._mm.close()
        except BufferError:  # a view still alive: the mapping goes with it
            pass
