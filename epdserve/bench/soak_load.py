"""The soak's load and its faults: client threads looping over the catalogue until told to stop,
and one instance SIGKILLed every `kill_every_s`, the roles taken in turn.

Owns `SoakLoad` (`concurrency` threads, each with its own `Client` — default retry policy —
sending the catalogue's items in turn, thread k starting at item k; every request's `Sent` kept)
and `kill_rotation(...)`: at each kill time it picks, among the live instances whose roles are
exactly the next role of `roles` (E, P, D, E, ...), the youngest (so a role's older instance runs
the whole soak and its memory reading spans it), SIGKILLs it (`chaos_faults.kill`) and waits
until the launcher's supervisor started a new one and the scheduler sees every instance HEALTHY
again (`chaos_faults.wait_back`), recording both delays.
"""
from __future__ import annotations

import sys
import threading
import time
from dataclasses import asdict, dataclass

from epdserve.bench import chaos_faults as faults
from epdserve.bench.soak_traffic import Sent, SoakItem, send


class SoakLoad:
    def __init__(self, address: str, items: list[SoakItem], concurrency: int, request_timeout_s: float = 300.0):
        self.address, self.items, self.timeout = address, items, request_timeout_s
        self.sent: list[Sent] = []
        self.t_start = time.monotonic()
        self._seeds = iter(range(1, 1 << 62))
        self._stop = threading.Event()
        self._lock = threading.Lock()
        self._threads = [threading.Thread(target=self._loop, args=(k,), name=f"soak-client-{k}", daemon=True)
                         for k in range(concurrency)]

    def start(self) -> SoakLoad:
        for t in self._threads:
            t.start()
        return self

    def stop(self) -> list[Sent]:
        """Stop sending; wait for the requests in flight; every request's `Sent`."""
        self._stop.set()
        for t in self._threads:
            t.join()
        return self.sent

    def _loop(self, k: int) -> None:
        from epdserve.client import Client

        with Client(self.address, timeout=self.timeout) as c:
            i = k
            while not self._stop.is_set():
                item = self.items[i % len(self.items)]
                with self._lock:
                    seed = next(self._seeds)
                s = send(c, item, seed)
                with self._lock:
                    self.sent.append(s)
                i += 1


@dataclass
class Kill:
    role: str
    pid: int
    t_s: float  # since the load started
    process_s: float | None = None  # until the supervisor's new process ran
    roster_s: float | None = None  # until the scheduler saw every instance HEALTHY again (None: not within the timeout)

    def to_dict(self) -> dict:
        return asdict(self)


def youngest(launcher_pid: int, role: str):
    """The most recently started live instance whose roles are exactly `role`, or None."""
    procs = [p for kind, p in faults.children(launcher_pid) if kind == role]
    return max(procs, key=lambda p: (p.create_time(), p.pid), default=None)


def kill_rotation(launcher_pid: int, address: str, cluster_token: str, instances: int, roles: list[str],
                  kill_every_s: float, until: float, t_start: float, back_timeout_s: float,
                  kill=faults.kill) -> list[Kill]:
    """Kill one instance every `kill_every_s` (the first `kill_every_s` after `t_start`) while the
    next kill time is before `until` (time.monotonic); the kills done. `kill`: how a process is
    killed (the benchmark's SIGKILL)."""
    done: list[Kill] = []
    n = 0
    while roles:
        at = t_start + (n + 1) * kill_every_s
        if at >= until:
            break
        time.sleep(max(0.0, at - time.monotonic()))  # the schedule itself: a kill every kill_every_s
        role = roles[n % len(roles)]
        victim = youngest(launcher_pid, role)
        if victim is None:
            raise RuntimeError(f"no live {role} instance to kill")
        before = {p.pid for kind, p in faults.children(launcher_pid) if kind == role}
        t = time.monotonic()
        kill(victim)
        k = Kill(role, victim.pid, round(t - t_start, 1))
        back = faults.wait_back(launcher_pid, address, cluster_token, role, before, instances, t, back_timeout_s)
        if back is not None:
            k.process_s, k.roster_s = round(back.process_s, 1), round(back.roster_s, 1)
        done.append(k)
        print(f"soak: killed {role} (pid {victim.pid}) at {k.t_s:.0f} s; roster whole again after "
              f"{'-' if k.roster_s is None else f'{k.roster_s:.1f}'} s", file=sys.stderr, flush=True)
        n += 1
    time.sleep(max(0.0, until - time.monotonic()))  # the rest of the soak's duration
    return done
