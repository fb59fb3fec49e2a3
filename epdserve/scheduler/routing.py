"""Routing: which instances run one request attempt, by least outstanding work.

Pipelines: a coupled instance (roles PD or EPD, one engine) takes the whole request;
otherwise a P instance prefills and a separate D instance decodes. Media that need encoding
are spread across E instances (each item to the E with the least outstanding vision tokens,
counting what this request already gave it). Text-only requests, media known to be in the MM
Store, and requests whose prefilling instance encodes inline (EPD; P+E in mode P-D) skip E.

Work per pool (the scheduler's own count of dispatched, unfinished work): E vision tokens, P
prompt tokens, D and coupled (prompt +) max_tokens of requests on them. Ties go round-robin by
a cursor that remembers the *id* last chosen in each pool and continues with the next id in
order, so it survives instances joining and leaving (an index would jump).

Backpressure: an instance already running `max_inflight_per_instance` attempts is skipped; a
pool with instances but all of them full raises RESOURCE_EXHAUSTED, an empty pool UNAVAILABLE.
Instances in `avoid` (they just failed this request) are used only when nothing else is left.
"""
from __future__ import annotations

from dataclasses import dataclass, field

from epdserve.scheduler.errors import RequestError
from epdserve.scheduler.registry import InstanceRecord, InstanceRegistry

_ROLE_NAMES = {"E": "encode (E)", "P": "prefill (P)", "D": "decode (D)", "PD": "prefill+decode"}


class Cursor:
    """Round-robin among tied candidates, keyed by instance id."""

    def __init__(self):
        self.last: str | None = None

    def choose(self, tied: list[InstanceRecord]) -> InstanceRecord:
        ordered = sorted(tied, key=lambda r: r.instance_id)
        pick = next((r for r in ordered if self.last is not None and r.instance_id > self.last), ordered[0])
        self.last = pick.instance_id
        return pick


@dataclass
class Plan:
    """The instances of one attempt. Exactly one of `coupled` / (`prefill`, `decode`) is set."""

    coupled: InstanceRecord | None = None
    prefill: InstanceRecord | None = None
    decode: InstanceRecord | None = None
    encodes: list[tuple[InstanceRecord, list[int]]] = field(default_factory=list)  # E -> media indices

    @property
    def target(self) -> InstanceRecord:
        """The instance that prefills (feature events go to it)."""
        return self.coupled or self.prefill

    def instances(self) -> list[InstanceRecord]:
        out = {r.instance_id: r for r in (self.coupled, self.prefill, self.decode) if r is not None}
        for rec, _ in self.encodes:
            out.setdefault(rec.instance_id, rec)
        return list(out.values())


class WorkLease:
    """The work one attempt put on instances; `done(role)` / `release()` give it back (idempotent)."""

    def __init__(self):
        self._held: list[tuple[InstanceRecord, str, int]] = []
        self._inflight: list[InstanceRecord] = []

    def add(self, rec: InstanceRecord, role: str, units: int) -> None:
        rec.outstanding[role] += units
        self._held.append((rec, role, units))
        if all(r is not rec for r in self._inflight):
            rec.inflight += 1
            self._inflight.append(rec)

    def done(self, role: str) -> None:
        keep = []
        for rec, r, units in self._held:
            if r == role:
                rec.outstanding[r] -= units
            else:
                keep.append((rec, r, units))
        self._held = keep

    def release(self) -> None:
        for rec, r, units in self._held:
            rec.outstanding[r] -= units
        for rec in self._inflight:
            rec.inflight -= 1
        self._held, self._inflight = [], []


class Router:
    def __init__(self, registry: InstanceRegistry, max_inflight_per_instance: int = 256):
        self.registry = registry
        self.max_inflight = max_inflight_per_instance
        self._cursors: dict[str, Cursor] = {}

    def plan(self, prompt_tokens: int, max_tokens: int, media_tokens: list[int], encode: list[int],
             avoid: set[str] = frozenset()) -> tuple[Plan, WorkLease]:
        """Choose instances for one attempt and lease their work.

        media_tokens: vision tokens of every media item; encode: indices of the items that need E.
        """
        plan = Plan()
        if self.registry.candidates("PD"):
            plan.coupled = self._pick("PD", avoid, {})
        else:
            plan.prefill = self._pick("P", avoid, {})
            plan.decode = self._pick("D", avoid, {})
        inline = plan.target.encodes_inline  # EPD, or P+E (mode P-D)
        if encode and not inline and self.registry.candidates("E"):
            extra: dict[str, int] = {}
            groups: dict[str, tuple[InstanceRecord, list[int]]] = {}
            for i in encode:
                rec = self._pick("E", avoid, extra)
                extra[rec.instance_id] = extra.get(rec.instance_id, 0) + media_tokens[i]
                groups.setdefault(rec.instance_id, (rec, []))[1].append(i)
            plan.encodes = list(groups.values())
        lease = WorkLease()
        if plan.coupled is not None:
            lease.add(plan.coupled, "PD", prompt_tokens + max_tokens)
        else:
            lease.add(plan.prefill, "P", prompt_tokens)
            lease.add(plan.decode, "D", max_tokens)
        for rec, items in plan.encodes:
            lease.add(rec, "E", sum(media_tokens[i] for i in items))
        return plan, lease

    def _pick(self, role: str, avoid: set[str], extra: dict[str, int]) -> InstanceRecord:
        pool = self.registry.candidates(role)
        if not pool:
            raise RequestError.unavailable(f"no healthy {_ROLE_NAMES[role]} instance")
        fresh = [r for r in pool if r.instance_id not in avoid] or pool
        open_ = [r for r in fresh if r.inflight < self.max_inflight]
        if not open_:
            raise RequestError.exhausted(
                f"every {_ROLE_NAMES[role]} instance is at its limit of {self.max_inflight} requests in flight"
            )
        work = {r.instance_id: r.outstanding[role] + extra.get(r.instance_id, 0) for r in open_}
        least = min(work.values())
        tied = [r for r in open_ if work[r.instance_id] == least]
        return self._cursors.setdefault(role, Cursor()).choose(tied)
