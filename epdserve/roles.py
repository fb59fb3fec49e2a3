"""Role sets as one data table: what each `--roles` value means, read off a record, never tested as a string.

`ROLE_TABLE` is the only place a role set is defined (the deployment modes that use them are
`instance/modes.py`'s `MODE_TABLE`, whose pools name these records). Each `RoleSet` says:

- `stages`: the stages its engines run, as `ENCODE` / `PREFILL` / `DECODE` letters;
- `workers`: the stage workers an instance of it builds (names of worker role sets: `EP` is an
  E worker and a P worker, co-located, each with its own engine; `PD` / `EPD` one coupled engine);
- `serves`: the stages other processes may call on it: `ENCODE` (the Encode RPC), `PREFILL`
  (Prefill), `DECODE` (Decode); one that serves both P and D is `coupled`: one engine takes whole
  requests (Generate, the router's `COUPLED` pool). "P+E" serves P only (it encodes inline, for its
  own requests);
- `encodes_inline`: its prefilling engine encodes the media of its own requests (EPD; `P+E`, mode
  P-D), so no E instance is asked;
- `holds_kv`: its engines hold request KV (it prefills or decodes; an E-only one does not).

Everything else is derived from those fields (`encodes`, `prefills`, `decodes`, `coupled`,
`sends_kv`, `receives_kv`, `encodes_for_others`, `worker_key`, `rpcs` ...). A role string is
parsed once, where it enters (`parse_roles`: the CLI's and configs' `--roles`, a registration, a
SwitchRoles request); inside, code holds the canonical name and asks its record (`role_set`).
tests/test_role_table.py fails on a role string test (`"D" in roles`, `roles == "EPD"`, ...)
anywhere else in the package.
No imports of epdserve: every layer may read it.
"""
from __future__ import annotations

from dataclasses import dataclass

ENCODE, PREFILL, DECODE = "E", "P", "D"
STAGES = (ENCODE, PREFILL, DECODE)
COUPLED = "PD"  # the pool of instances that take whole requests (Generate), beside E, P and D
POOLS = (ENCODE, PREFILL, DECODE, COUPLED)
RPCS = {ENCODE: "Encode", PREFILL: "Prefill", DECODE: "Decode", COUPLED: "Generate"}  # Instance service, per pool
FUSED_PREFILL = "P+E"  # one engine that encodes inline, then prefills and hands KV to a D (mode P-D)


@dataclass(frozen=True)
class RoleSet:
    name: str  # canonical: "E", "P", "D", "EP", "ED", "PD", "EPD", "P+E"
    stages: frozenset[str]
    workers: tuple[str, ...]
    serves: frozenset[str]
    encodes_inline: bool
    holds_kv: bool
    summary: str  # one line for --help and docs

    def __str__(self) -> str:
        return self.name

    @property
    def encodes(self) -> bool:
        """Its engines run the vision encoder (for other instances' requests or, inline, its own)."""
        return ENCODE in self.stages

    @property
    def prefills(self) -> bool:
        return PREFILL in self.stages

    @property
    def decodes(self) -> bool:
        return DECODE in self.stages

    @property
    def coupled(self) -> bool:
        """One engine prefills and decodes (PD, EPD): it takes whole requests."""
        return {PREFILL, DECODE} <= self.serves

    @property
    def sends_kv(self) -> bool:
        """It prefills for a decode elsewhere (P, EP, P+E): the P side of a KV hop."""
        return self.prefills and not self.decodes

    @property
    def receives_kv(self) -> bool:
        """It decodes what was prefilled elsewhere (D, ED): the D side of a KV hop."""
        return self.decodes and not self.prefills

    @property
    def encode_only(self) -> bool:
        """It only encodes (E): no KV, no prefill."""
        return self.stages == {ENCODE}

    @property
    def encodes_for_others(self) -> bool:
        """It encodes media for other instances' prefills (E, EP, ED): a prefiller that does not
        encode inline needs one."""
        return ENCODE in self.serves and not self.encodes_inline

    def takes(self, pool: str) -> bool:
        """Does the router send it calls of `pool` (E, P, D; PD: whole requests)?"""
        return self.coupled if pool == COUPLED else pool in self.serves

    @property
    def worker_key(self) -> str:
        """The pool whose calls a worker of this role set takes (a worker's record only): PD for
        a coupled engine, else the one stage it serves."""
        if len(self.workers) != 1:
            raise ValueError(f"roles {self.name} build {len(self.workers)} workers, not one")
        if self.coupled:
            return COUPLED
        (key,) = self.serves
        return key

    @property
    def rpcs(self) -> tuple[str, ...]:
        """The Instance RPCs its workers answer (instance/servicer.py), one per worker."""
        return tuple(RPCS[w.worker_key] for w in self.worker_sets)

    @property
    def worker_sets(self) -> tuple["RoleSet", ...]:
        """The records of `workers`."""
        return tuple(ROLE_TABLE[w] for w in self.workers)


def _rs(name, stages, workers, serves, inline, summary) -> RoleSet:
    return RoleSet(name, frozenset(stages), tuple(workers), frozenset(serves), inline,
                   bool(set(stages) & {PREFILL, DECODE}), summary)


_TABLE: tuple[RoleSet, ...] = (
    _rs("E", "E", ("E",), "E", False, "encodes media for other instances' prefills"),
    _rs("P", "P", ("P",), "P", False, "prefills with features an E sent, hands the KV to a D"),
    _rs("D", "D", ("D",), "D", False, "decodes requests prefilled elsewhere"),
    _rs("EP", "EP", ("E", "P"), "EP", False, "an E worker and a P worker co-located on one device"),
    _rs("ED", "ED", ("E", "D"), "ED", False, "an E worker and a D worker co-located on one device"),
    _rs("PD", "PD", ("PD",), "PD", False, "one engine prefills and decodes, media encoded by an E"),
    _rs("EPD", "EPD", ("EPD",), "EPD", True, "one engine encodes, prefills and decodes (monolithic)"),
    _rs(FUSED_PREFILL, "EP", (FUSED_PREFILL,), "P", True,
        "one engine encodes inline and prefills, hands the KV to a D (mode P-D)"),
)
ROLE_TABLE: dict[str, RoleSet] = {r.name: r for r in _TABLE}
ROLES = tuple(ROLE_TABLE)


def parse_roles(text: str | RoleSet) -> RoleSet:
    """The record of a role string as a user writes it: a non-empty set of E, P, D (each at most
    once, any order, case-insensitive, spaces ignored: "pe" is EP), or "P+E". ValueError for
    anything else."""
    if isinstance(text, RoleSet):
        return text
    raw = (text or "").strip().upper().replace(" ", "")
    if raw in ROLE_TABLE:
        return ROLE_TABLE[raw]
    if raw and set(raw) <= set(STAGES) and len(set(raw)) == len(raw):
        return ROLE_TABLE["".join(s for s in STAGES if s in raw)]
    raise ValueError(f"roles must be one of {', '.join(ROLES)}, got {text!r}")


def normalize_roles(text: str | RoleSet) -> str:
    """The canonical name of a role string ("pe" → "EP"); ValueError as `parse_roles`."""
    return parse_roles(text).name


def role_set(name: str | RoleSet) -> RoleSet:
    """The record of a canonical name (one `parse_roles` gave); ValueError for any other string."""
    if isinstance(name, RoleSet):
        return name
    try:
        return ROLE_TABLE[name]
    except KeyError:
        raise ValueError(f"roles must be one of {', '.join(ROLES)}, got {name!r}") from None
