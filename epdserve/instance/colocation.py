"""How co-located stages share one device: the co-location policy, the same object on CPU and NPU.

Co-located means E beside P or D in one instance (EP, ED), or an E process beside a P / PD / D
process on the same device (on one machine every mode is co-located). Two policies:

- `split` (static): each stage gets a fixed share — disjoint CPU core sets, or NPU stream core
  limits (`instance/stage_stream.py`). A stage runs at its share's speed even while the other
  idles.
- `yield` (work-conserving): every stage may use every core; encode runs at the lowest CPU
  priority (Linux SCHED_IDLE for its thread and the OpenMP team it spawns), so a P or D step
  that becomes runnable takes the cores from encode at the kernel's next scheduling decision
  (within one operator's slice on CPU), and encode uses every core while P and D idle. On NPU
  there is no such precedence: each stage gets an unlimited stream of its own, but torch_npu's
  streams carry no priority to the device (all created at ACL priority 0: NPUStream.cpp
  initDeviceStreamState; docs/npu-colocation.md).

Why SCHED_IDLE: nice 19 still has weight 15 against 1024 and does not protect decode; SCHED_IDLE
(weight 3, never preempts a normal thread) does (docs/measurements.md; the policies' current
figures: README 'Co-location policy'). Threads inherit the policy of the thread that creates
them, so the intra-op team an encode worker spawns at its first parallel op inherits it, as it
inherits the core set under `split` (`instance/affinity.py`). An unprivileged thread may enter SCHED_IDLE but
not leave it: each policy is set once, on a stage's own fresh thread. Served, `yield` starves
encode while P/D/scheduler keep the cores busy (README 'Co-location policy').
"""
from __future__ import annotations

import logging
import os
import threading

from epdserve.instance.affinity import pin_worker_thread
from epdserve.platform.cores import split_cores
from epdserve.roles import role_set

log = logging.getLogger(__name__)

POLICIES = ("split", "yield")


def worker_core_sets(policy: str, roles: list[str], cores: list[int], weights: list[float]) -> list[list[int] | None]:
    """Core set of each co-located CPU worker: disjoint by weight (`split`), or all of `cores`
    for every worker (`yield`, and a lone worker)."""
    check_policy(policy)
    if policy != "split" or len(roles) < 2:
        return [list(cores) for _ in roles]
    return split_cores(len(roles), cores, weights)


def yields(policy: str, role: str) -> bool:
    """Does a worker of `role` give way to the others under `policy`? (Encode, under yield.)"""
    return check_policy(policy) == "yield" and not role_set(role).holds_kv


def device_share(policy: str, role: str, weight: float) -> float | None:
    """An accelerator worker's share of the device's cores: its weight under `split`, None (no
    limit: its own stream; prioritized on CUDA only) under `yield`."""
    return weight if check_policy(policy) == "split" else None


def stream_priority(policy: str, role: str) -> int:
    """Stream priority (lower = higher, as CUDA's Stream takes it): P/D streams outrank encode's
    under `yield`; under `split` all are equal (0). CUDA only: `NpuPlatform.new_stream`
    ignores it (torch_npu's pool streams are all at ACL priority 0)."""
    return -1 if check_policy(policy) != "split" and role_set(role).holds_kv else 0


def enter_stage_thread(cores: list[int] | None, low_priority: bool) -> list[int]:
    """First thing in a stage worker's thread, before its first tensor op: pin it to `cores`
    (None: all of the process's), size its torch team, and, for a yielding stage, drop the
    thread (and so the team it will spawn) to SCHED_IDLE. Returns the thread's cores."""
    if low_priority:  # first: torch.set_num_threads (in pinning) may already start a thread
        set_idle_priority()
    return pin_worker_thread(cores)


def set_idle_priority() -> bool:
    """SCHED_IDLE for the calling thread (nice 19 where SCHED_IDLE is unavailable); False if neither."""
    tid = threading.get_native_id()
    try:
        os.sched_setscheduler(tid, os.SCHED_IDLE, os.sched_param(0))
        return True
    except (AttributeError, OSError) as e:
        try:
            os.setpriority(os.PRIO_PROCESS, tid, 19)
            log.info("SCHED_IDLE unavailable (%s); encode thread at nice 19", e)
            return True
        except (AttributeError, OSError) as e2:
            log.warning("cannot lower the encode thread's priority (%s); it competes with P/D at equal priority", e2)
            return False


def check_policy(policy: str) -> str:
    if policy not in POLICIES:
        raise ValueError(f"co-location policy must be one of {', '.join(POLICIES)}, got {policy!r}")
    return policy
