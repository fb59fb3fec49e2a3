"""Routing: which instances run one request attempt, by least outstanding work and cached prefix.

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

Cache-aware routing (policy "cache-aware", the default; "least-load" turns it off): the
instance that prefills (coupled, or P) is chosen by cost = its outstanding work + the prompt
tokens it would have to prefill for this request, i.e. the prompt less the prefix it probably
holds (`PrefixIndex.matched` blocks x its registered block size, the prompt hashed in blocks of
that size: `prompt_chunks.py`; from where this router sent earlier prompts); the lowest cost
wins, ties to the longer prefix, then the id cursor. This is the cost
Dynamo's KV router minimises (prefill blocks still to compute + load). Work is in the same
token units as least-load, so a held prefix is worth exactly the prefill it saves: an instance
holding a hot prefix takes its requests until its queue is longer than the others' by more than
that prefix, then the next one goes elsewhere (and that instance holds the prefix from then on),
so a hot prefix cannot starve the rest. The lease counts only the uncached part of the prompt.
With no prefix held anywhere (or a prompt shorter than one block) it is least-load exactly. D
instances and E are always least-load. The chosen instance is recorded in the index.

Degree: an instance whose language model is split over N devices (its registered `KvLayout`'s
degree) counts its outstanding work, and a prefill's cost, divided by N — work per device — so
between a D at TP4 and one at TP1 the TP4 one takes about four times the work before the other
is chosen (issue 48: routing accounts for degree).
"""
from __future__ import annotations

from dataclasses import dataclass, field

from epdserve.scheduler.config import ROUTINGS
from epdserve.scheduler.errors import RequestError
from epdserve.scheduler.prefix_index import DEFAULT_CAPACITY, PrefixIndex
from epdserve.scheduler.registry import InstanceRecord, InstanceRegistry

_ROLE_NAMES = {"E": "encode (E)", "P": "prefill (P)", "D": "decode (D)", "PD": "prefill+decode"}
POLICIES = ROUTINGS  # `epdserve scheduler --routing` (scheduler/config.py)


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
    prefix_tokens: int = 0  # prompt tokens the index expects the target to hold already

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
    """`policy`: one of POLICIES; `index_capacity`: block hashes remembered per instance."""

    def __init__(self, registry: InstanceRegistry, max_inflight_per_instance: int = 256,
                 policy: str = "cache-aware", index_capacity: int = DEFAULT_CAPACITY):
        if policy not in POLICIES:
            raise ValueError(f"routing policy must be one of {', '.join(POLICIES)}, got {policy!r}")
        self.registry = registry
        self.max_inflight = max_inflight_per_instance
        self.policy = policy
        self.index = PrefixIndex(index_capacity)
        self._cursors: dict[str, Cursor] = {}
        registry.on_down(lambda rec: self.index.forget(rec.instance_id))

    @property
    def cache_aware(self) -> bool:
        """Does `plan` use prompt block hashes (`prefix=`)?"""
        return self.policy == "cache-aware"

    def plan(self, prompt_tokens: int, max_tokens: int, media_tokens: list[int], encode: list[int],
             avoid: set[str] = frozenset(), prefix: dict[int, list[bytes]] | None = None) -> tuple[Plan, WorkLease]:
        """Choose instances for one attempt and lease their work.

        media_tokens: vision tokens of every media item; encode: indices of the items that need E;
        prefix: the prompt's block hashes by block size (`PromptChunker.by_block_size`), for
        cache-aware routing; an instance whose block size is not there is taken to hold none.
        """
        plan = Plan()
        if self.registry.candidates("PD"):
            plan.coupled, plan.prefix_tokens = self._pick_prefill("PD", avoid, prefix, prompt_tokens)
        else:
            plan.prefill, plan.prefix_tokens = self._pick_prefill("P", avoid, prefix, prompt_tokens)
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
        fresh = prompt_tokens - plan.prefix_tokens
        if plan.coupled is not None:
            lease.add(plan.coupled, "PD", fresh + max_tokens)
        else:
            lease.add(plan.prefill, "P", fresh)
            lease.add(plan.decode, "D", max_tokens)
        for rec, items in plan.encodes:
            lease.add(rec, "E", sum(media_tokens[i] for i in items))
        return plan, lease

    def encoder(self, media_tokens: int) -> tuple[InstanceRecord, WorkLease] | None:
        """An E instance for one item encoded outside any request (an upload), its work leased;
        None when the deployment has no E instance (prefilling instances encode inline)."""
        if not self.registry.candidates("E"):
            return None
        rec, lease = self._pick("E", set(), {}), WorkLease()
        lease.add(rec, "E", media_tokens)
        return rec, lease

    def encoders(self) -> list[InstanceRecord]:
        """Every routable E instance (a deleted upload's features are dropped through one)."""
        return list(self.registry.candidates("E"))

    def _pick_prefill(self, role: str, avoid: set[str], prefix: dict[int, list[bytes]] | None,
                      prompt_tokens: int) -> tuple[InstanceRecord, int]:
        """The prefilling instance ("PD" or "P") and the prompt tokens it probably holds."""
        if not self.cache_aware or not prefix:
            return self._pick(role, avoid, {}), 0
        open_ = self._open(role, avoid)
        held = {r.instance_id: min(self.index.matched(r, prefix.get(r.block_size, ())) * r.block_size, prompt_tokens)
                for r in open_}
        cost = {r.instance_id: (r.outstanding[role] + prompt_tokens - held[r.instance_id]) / r.degree for r in open_}
        least = min(cost.values())
        tied = [r for r in open_ if cost[r.instance_id] == least]
        longest = max(held[r.instance_id] for r in tied)
        pick = self._cursors.setdefault(role, Cursor()).choose([r for r in tied if held[r.instance_id] == longest])
        self.index.record(pick, prefix.get(pick.block_size, ()))
        return pick, held[pick.instance_id]

    def _pick(self, role: str, avoid: set[str], extra: dict[str, int]) -> InstanceRecord:
        open_ = self._open(role, avoid)
        work = {r.instance_id: (r.outstanding[role] + extra.get(r.instance_id, 0)) / r.degree for r in open_}
        least = min(work.values())
        tied = [r for r in open_ if work[r.instance_id] == least]
        return self._cursors.setdefault(role, Cursor()).choose(tied)

    def _open(self, role: str, avoid: set[str]) -> list[InstanceRecord]:
        """`role`'s routable instances not at their in-flight limit, those in `avoid` only if
        nothing else is left. Raises UNAVAILABLE (none) or RESOURCE_EXHAUSTED (all full)."""
        pool = self.registry.candidates(role)
        if not pool:
            raise RequestError.unavailable(f"no healthy {_ROLE_NAMES[role]} instance")
        fresh = [r for r in pool if r.instance_id not in avoid] or pool
        open_ = [r for r in fresh if r.inflight < self.max_inflight]
        if not open_:
            raise RequestError.exhausted(
                f"every {_ROLE_NAMES[role]} instance is at its limit of {self.max_inflight} requests in flight"
            )
        return open_
