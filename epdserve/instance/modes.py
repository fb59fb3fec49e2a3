"""The deployment modes as one data table: which instances each mode runs, and how many.

`MODE_TABLE` is the only place a mode is defined. Each `Mode` lists its pools in launch order;
a `PoolRule` says which role set its instances run and which of the per-role counts that
`epdserve launch` takes (`encode`, `prefill`, `decode`) sizes it:

- `count`: the count that sizes the pool;
- `beyond`: the pool holds only the part of `count` beyond that other count (EP-D's E-only
  instances are the E workers beyond the ones co-located with P);
- `at_least`: a floor (monolithic always has one instance).

Everything else is read off the table, never written per mode: `mode_pools` (instances for the
counts: instances, launch, bench), `counts_of_pools` (its inverse: the planner reading a ready
line), `candidate_counts` (every split of a device budget: the planner), `mode_of_roles` (the
mode a roster adds up to: the scheduler's GetServerInfo), `pool_degree` (each pool's
tensor-parallel degree: encode-only pools their own, the rest the language model's). What a pool's role set runs — its
stages, its workers, the calls it takes, whether it encodes inline or holds KV — is its record in
the role table beside this one (`epdserve/roles.py` `ROLE_TABLE`, below every layer so that the
engine reads it too); a pool names its record.
"""
from __future__ import annotations

import itertools
from dataclasses import dataclass

from epdserve.roles import DECODE, FUSED_PREFILL, PREFILL, ROLE_TABLE, role_set

COUNTS = ("encode", "prefill", "decode")


@dataclass(frozen=True)
class PoolRule:
    """One pool of a mode: instances running `roles`, as many as the rule gives."""

    roles: str  # a name of ROLE_TABLE
    count: str  # one of COUNTS
    beyond: str | None = None  # one of COUNTS: only the part of `count` beyond it
    at_least: int = 0

    def __post_init__(self):
        if self.roles not in ROLE_TABLE:
            raise ValueError(f"pool roles {self.roles!r} are not in the role table")

    def size(self, counts: dict[str, int]) -> int:
        n = counts[self.count] - (counts[self.beyond] if self.beyond else 0)
        return max(self.at_least, n)


@dataclass(frozen=True)
class Mode:
    name: str
    pools: tuple[PoolRule, ...]
    summary: str  # one line for --help and the README

    @property
    def counts_used(self) -> tuple[str, ...]:
        """The counts that size this mode's pools, in the order the pools name them."""
        return tuple(dict.fromkeys(r.count for r in self.pools))

    @property
    def roles(self) -> frozenset[str]:
        return frozenset(r.roles for r in self.pools)


MODE_TABLE: tuple[Mode, ...] = (
    Mode("monolithic", (PoolRule("EPD", "prefill", at_least=1),),
         "one engine per instance encodes, prefills and decodes"),
    Mode("P-D", (PoolRule(FUSED_PREFILL, "prefill"), PoolRule("D", "decode")),
         "P encodes inline and prefills, D decodes (EPD-Serve's PD disaggregation)"),
    Mode("E-P-D", (PoolRule("E", "encode"), PoolRule("P", "prefill"), PoolRule("D", "decode")),
         "every stage an instance of its own"),
    Mode("EP-D", (PoolRule("EP", "prefill"), PoolRule("E", "encode", beyond="prefill"), PoolRule("D", "decode")),
         "E and P co-located on one device, D apart"),
    Mode("ED-P", (PoolRule("ED", "decode"), PoolRule("E", "encode", beyond="decode"), PoolRule("P", "prefill")),
         "E and D co-located on one device, P apart"),
    Mode("E-PD", (PoolRule("E", "encode"), PoolRule("PD", "prefill")),
         "E apart, prefill and decode coupled in one engine"),
)
MODES = tuple(m.name for m in MODE_TABLE)


@dataclass(frozen=True)
class Pool:
    """`count` instances that each run `roles`."""

    roles: str
    count: int


def get_mode(name: str) -> Mode:
    for m in MODE_TABLE:
        if m.name == name:
            return m
    raise ValueError(f"mode must be one of {', '.join(MODES)}, got {name!r}")


def mode_pools(mode: str, encode: int = 1, prefill: int = 1, decode: int = 1) -> list[Pool]:
    """Instance pools of a deployment mode from the per-role counts (empty pools left out);
    ValueError for a negative count or a deployment without both a P and a D."""
    m = get_mode(mode)
    counts = {"encode": encode, "prefill": prefill, "decode": decode}
    for name, n in counts.items():
        if n < 0:
            raise ValueError(f"--{name} must be >= 0, got {n}")
    pools = [p for p in (Pool(r.roles, r.size(counts)) for r in m.pools) if p.count > 0]
    have = frozenset().union(*(role_set(p.roles).stages for p in pools))
    missing = [s for s in (PREFILL, DECODE) if s not in have]
    if missing:
        raise ValueError(f"mode {mode} needs at least one instance with role(s) {', '.join(missing)}")
    return pools


def counts_of_pools(mode: str, pools: dict[str, int]) -> tuple[int, int, int]:
    """(encode, prefill, decode) whose `mode_pools` are `pools` ({roles: count}, as a ready
    line's `instances=` says); a count no pool of the mode uses is 1. ValueError when no counts
    give these pools."""
    m = get_mode(mode)
    counts = {c: 1 for c in COUNTS}
    for rule in sorted(m.pools, key=lambda r: r.beyond is not None):  # a `beyond` pool needs its base first
        counts[rule.count] = int(pools.get(rule.roles, 0)) + (counts[rule.beyond] if rule.beyond else 0)
    out = tuple(counts[c] for c in COUNTS)
    try:
        got = {p.roles: p.count for p in mode_pools(mode, *out)}
    except ValueError:
        got = None
    if got != {r: int(c) for r, c in pools.items() if int(c)}:
        raise ValueError(f"instances {pools} are not a {mode} deployment")
    return out


def candidate_counts(mode: str, n: int) -> list[tuple[int, int, int]]:
    """Every (encode, prefill, decode) of `mode` with each pool's count in 1..n (a `beyond`
    pool: 0..n-1 beyond its base), the counts a mode does not use at 1; in the order of the
    mode's pools, first pool outermost."""
    m = get_mode(mode)
    rules = {r.count: r for r in m.pools}
    ranges = [range(n) if rules[c].beyond else range(1, n + 1) for c in m.counts_used]
    out = []
    for values in itertools.product(*ranges):
        counts = {c: 1 for c in COUNTS}
        counts.update(zip(m.counts_used, values))
        for c in m.counts_used:
            if rules[c].beyond:
                counts[c] += counts[rules[c].beyond]
        out.append(tuple(counts[c] for c in COUNTS))
    return out


def mode_of_roles(roles: set[str] | frozenset[str]) -> str | None:
    """The mode whose pools a roster running these role sets comes from (E-only pools that a
    mode may leave empty need not be there); None when no mode fits."""
    roles = frozenset(roles)
    for m in MODE_TABLE:
        required = frozenset(r.roles for r in m.pools if not r.beyond)
        if required <= roles <= m.roles:
            return m.name
    return None


def pool_degree(roles: str, degree: int, encode_degree: int = 1) -> int:
    """The tensor-parallel degree of a pool's instances: `encode_degree` for encode-only ones (the
    vision encoder is small: E scales by replicas, EPD-Serve's and vLLM's "data" mode), `degree`
    for every instance that holds the language model. ValueError for a prefill-only or decode-only
    pool (P, EP, P+E, D, ED) at a degree above 1: its KV crosses to another instance through a KV
    connector, which a tensor-parallel engine does not take yet (issue 48's hop between degrees)."""
    rs = role_set(roles)
    if not rs.prefills and not rs.decodes:
        return encode_degree
    if degree > 1 and rs.prefills != rs.decodes:
        raise ValueError(f"a {roles} instance at tensor_parallel_size {degree}: its KV crosses to another instance, "
                         f"which a tensor-parallel instance cannot do yet; run the language model at TP > 1 in a "
                         f"mode whose instances prefill and decode (monolithic, E-PD)")
    return degree
