"""CPU core partitioning for co-located stage workers (the CPU analogue of NPU stream limits).

An instance hosting two stage workers (E+P, E+D) on CPU gives each worker a disjoint core
set by default. `split_cores` (platform/cores.py) divides the cores this process may use; `pin_worker_thread`
runs first thing in a worker's loop thread.

How torch threads are split (checked on torch 2.13 / libgomp):
- `os.sched_setaffinity(threading.get_native_id(), cores)` pins only the calling OS thread.
- Threads inherit the affinity of the thread that creates them, and OpenMP keeps one thread
  pool per thread that opens a parallel region, so the intra-op team a worker thread spawns
  (at its first parallel op, after pinning) runs on that worker's cores only.
- `torch.set_num_threads(n)` sets the calling thread's OpenMP team size (a per-thread ICV) and
  the default for threads that have not run a parallel op yet; each worker calls it with the
  size of its own core set, so worker A's team never grows onto worker B's cores.
- gRPC and other helper threads keep the process's full affinity; they do no tensor math.
With fewer cores than workers (e.g. 2 workers on 1 core) the workers share all cores.
"""
from __future__ import annotations

import logging
import os
import threading


log = logging.getLogger(__name__)


def parse_core_list(text: str) -> list[int]:
    """Parse a taskset-style core list: "0-3,6,8-9" → [0, 1, 2, 3, 6, 8, 9]."""
    cores: set[int] = set()
    for part in text.split(","):
        part = part.strip()
        if not part:
            continue
        if "-" in part:
            lo, hi = (int(x) for x in part.split("-", 1))
            if hi < lo:
                raise ValueError(f"bad core range {part!r}")
            cores.update(range(lo, hi + 1))
        else:
            cores.add(int(part))
    if not cores:
        raise ValueError(f"empty core list {text!r}")
    return sorted(cores)


def format_core_list(cores: list[int]) -> str:
    """The taskset-style text of a core list: [0, 1, 2, 3, 6] → "0-3,6"."""
    out, cores = [], sorted(set(cores))
    i = 0
    while i < len(cores):
        j = i
        while j + 1 < len(cores) and cores[j + 1] == cores[j] + 1:
            j += 1
        out.append(str(cores[i]) if i == j else f"{cores[i]}-{cores[j]}")
        i = j + 1
    return ",".join(out)


def compute_id(device, cores: list[int] | None, hostname: str) -> str:
    """What an instance's steps run on, as `InstanceStatus.compute` reports it: "cpu@HOST" (every
    core the host lets it use), "cpu:0-3@HOST" (pinned), "npu:3@HOST" / "cuda:0@HOST"; equal
    values share compute (the role controller does not start a second engine on compute that
    already runs one)."""
    kind, _, index = str(device).partition(":")
    if kind == "cpu":
        return f"cpu:{format_core_list(cores)}@{hostname}" if cores else f"cpu@{hostname}"
    return f"{kind}:{index or 0}@{hostname}"


def pin_worker_thread(cores: list[int] | None) -> list[int]:
    """Pin the calling thread to `cores` and size its torch intra-op team to match.

    Call before the thread's first tensor op. Returns the cores the thread now runs on.
    `None` leaves the affinity alone (the thread shares the process's cores).
    """
    if cores is not None and hasattr(os, "sched_setaffinity"):
        try:
            os.sched_setaffinity(threading.get_native_id(), set(cores))
        except OSError as e:  # e.g. a core outside the cgroup's cpuset
            log.warning("cannot pin %s to cores %s (%s); sharing all cores", threading.current_thread().name, cores, e)
    import torch  # here, not at the top: `epdserve launch|instance --help` read this module's constants

    now = sorted(os.sched_getaffinity(threading.get_native_id())) if hasattr(os, "sched_getaffinity") else []
    torch.set_num_threads(max(1, len(now) or torch.get_num_threads()))
    return now


def thread_cores() -> list[int]:
    """Cores the calling thread may run on."""
    return sorted(os.sched_getaffinity(threading.get_native_id()))
