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
tensor-parallel degree: encode-only, prefill-only and decode-only pools their own, the rest the
language model's) and `pool_degrees` (every pool's, refusing a P->D pair of degrees the KV hop
does not carry). What a pool's role set runs — its stages, its workers, the calls it takes,
whether it encodes inline or holds KV — is its record in the role table beside this one
(`epdserve/roles.py` `ROLE_TABLE`, below every layer so that the engine reads it too); a pool
names its record.
"""
from __future__ import annotations

import itertools
from dataclasses import dataclass

from epdserve import kv_layout
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


DEGREE_FLAGS = {"lm": "--tensor-parallel-size", "encode": "--encode-tensor-parallel-size",
                "prefill": "--prefill-tensor-parallel-size", "decode": "--decode-tensor-parallel-size"}


def pool_degree(roles: str, degree: int, encode_degree: int = 1, prefill_degree: int = 0,
                decode_degree: int = 0) -> int:
    """The tensor-parallel degree of a pool's instances: `encode_degree` for encode-only ones (the
    vision encoder is small: E scales by replicas, EPD-Serve's and vLLM's "data" mode);
    `prefill_degree` for those that prefill for a decode elsewhere (P, EP, P+E), `decode_degree` for
    those that decode what was prefilled elsewhere (D, ED) — 0: `degree`, as for the instances that
    prefill and decode (PD, EPD). Whether the P->D hop carries the pair is `pool_degrees`' question."""
    for stage, d in (("lm", degree), ("encode", encode_degree)):
        if d < 1:
            raise ValueError(f"{DEGREE_FLAGS[stage]} must be >= 1, got {d}")
    for stage, d in (("prefill", prefill_degree), ("decode", decode_degree)):
        if d < 0:
            raise ValueError(f"{DEGREE_FLAGS[stage]} must be >= 0 (0: {DEGREE_FLAGS['lm']}), got {d}")
    rs = role_set(roles)
    if rs.encode_only:
        return encode_degree
    if rs.sends_kv:
        return prefill_degree or degree
    if rs.receives_kv:
        return decode_degree or degree
    return degree


def pool_degrees(pools: list[Pool], degree: int, encode_degree: int = 1, prefill_degree: int = 0,
                 decode_degree: int = 0) -> list[int]:
    """Each pool's degree (`pool_degree`), in the pools' order: the one check `epdserve launch`, the
    local deployment and the Kubernetes renderer ask before anything starts. ValueError, naming both
    degrees and their flags, when the mode has P->D KV pairs (a pool that prefills for a decode
    elsewhere and one that decodes what was prefilled elsewhere) at degrees the layerwise KV hop does
    not carry (`epdserve.kv_layout.hop_carries`, asked: which pairs it carries is its own word)."""
    out = [pool_degree(p.roles, degree, encode_degree, prefill_degree, decode_degree) for p in pools]
    senders = [(p.roles, d) for p, d in zip(pools, out) if role_set(p.roles).sends_kv]
    receivers = [(p.roles, d) for p, d in zip(pools, out) if role_set(p.roles).receives_kv]
    for p_roles, p in senders:
        for d_roles, d in receivers:
            if not kv_layout.hop_carries(p, d):
                raise ValueError(
                    f"the {p_roles} instances prefill at tensor_parallel_size {p} ({DEGREE_FLAGS['prefill']}; 0 "
                    f"takes {DEGREE_FLAGS['lm']}) and the {d_roles} instances decode at tensor_parallel_size {d} "
                    f"({DEGREE_FLAGS['decode']}): the P->D KV hop does not carry KV from TP{p} to TP{d} "
                    f"(epdserve.kv_layout.hop_carries); give the two a pair it carries, or run the language model "
                    f"at TP > 1 in a mode whose instances prefill and decode (monolithic, E-PD)")
    return out
