"""Fair share between tenants inside one engine: which waiting request is admitted next, and which
running one a lack of KV blocks preempts.

Every request carries its tenant (`Sequence.tenant`, a `TenantShare`: the name the scheduler
resolved from the caller's key, and the tenant's weight from the keys file, default 1). A
tenant's share is its running sequences — a request with n choices counts n from its admission,
as `max_num_seqs` counts it — divided by its weight. When the engine admits:
- `next_admission`: of the waiting requests that may run now (a grammar still compiling waits),
  the one whose tenant's share is the least; between tenants of equal share, the one admitted
  least recently (never: first); among one tenant's, the queue order (arrival, a preempted request
  first). One tenant alone is served in queue order, exactly as without tenants: it gets the whole
  engine;
- `preemption_victim`: the newest running request of the tenant with the greatest share.
- `fairness_victims`: when the request `next_admission` picked does not fit the engine's
  sequences, running sequences of other tenants that it may displace — each the newest single
  sequence (a forked choice, or a request of n = 1) of the tenant holding the greatest share, taken
  only while the move leaves the two tenants' shares more even than before (the newcomer's share
  with it admitted stays below the victim tenant's share without the victim). A tenant therefore
  never displaces its own requests, a request of n choices displaces nobody until it forks, and
  one tenant alone is never preempted for fairness. Displaced sequences go back to waiting and
  are recomputed (nothing is lost); the engine does this only where it computes the whole request
  (not on a prefill-only or decode-only side, where KV crosses to or from another instance).
So a tenant that floods (many requests, n = 128) fills the slots only while nobody else waits:
as slots free, another tenant's waiting requests go first until the shares even out. Weighted
fair queueing over slots (the scarce thing a step has: `max_num_seqs` and KV blocks), not over
time: nothing here reads a clock.
"""
from __future__ import annotations

from collections import defaultdict
from collections.abc import Callable, Iterable, Mapping

from epdserve.engine.sequence import Sequence


def shares(running: Iterable[Sequence]) -> dict[str, float]:
    """Each tenant's running sequences over its weight."""
    out: dict[str, float] = defaultdict(float)
    for s in running:
        out[s.tenant.name] += s.width / s.tenant.weight
    return out


def next_admission(waiting: Iterable[Sequence], running: Iterable[Sequence],
                   may_run: Callable[[Sequence], bool], last_admitted: Mapping[str, int]) -> Sequence | None:
    """The waiting request to admit next (None: none may run); `last_admitted`: tenant -> the
    number of its latest admission (the caller counts admissions)."""
    share = shares(running)
    best, best_key = None, None
    for s in waiting:
        if not may_run(s):
            continue
        key = (share.get(s.tenant.name, 0.0), last_admitted.get(s.tenant.name, -1))
        if best is None or key < best_key:
            best, best_key = s, key
    return best


def fairness_victims(cand: Sequence, running: Iterable[Sequence], room: int,
                     displaceable: Callable[[Sequence], bool]) -> list[Sequence]:
    """Running sequences to preempt so that `room` more sequences fit for `cand`, or [] when the
    shares do not allow it (see the module docstring); `displaceable`: may this one be preempted."""
    running = list(running)
    share = shares(running)
    mine = share.get(cand.tenant.name, 0.0) + cand.width / cand.tenant.weight
    victims: list[Sequence] = []
    freed = 0
    while freed < room:
        cands = [s for s in running if s.tenant.name != cand.tenant.name and s.width == 1 and s not in victims
                 and displaceable(s)]
        if not cands:
            return []
        v = max(cands, key=lambda s: (share[s.tenant.name], s.arrival))
        if not mine < share[v.tenant.name] - 1 / v.tenant.weight:
            return []
        share[v.tenant.name] -= 1 / v.tenant.weight
        victims.append(v)
        freed += 1
    return victims


def preemption_victim(running: Iterable[Sequence], exclude: Sequence) -> Sequence | None:
    """The running request to preempt: the newest of the tenant holding the greatest share."""
    cands = [s for s in running if s is not exclude]
    if not cands:
        return None
    share = shares(cands)
    return max(cands, key=lambda s: (share[s.tenant.name], s.arrival))
