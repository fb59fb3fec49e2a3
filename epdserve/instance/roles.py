"""Which stage workers an instance hosts for its `--roles`, and which deployment modes use which.

Roles (parsed by `epdserve.engine.roles.normalize_roles`) → workers:
- `EPD` is one coupled engine (monolithic): encode, prefill and decode in one step loop;
- `PD` is one coupled engine doing prefill + decode with continuous batching (mode E-PD);
- `EP` and `ED` are two co-located workers (E + P, E + D), each with its own queue, engine and
  loop thread, splitting the device (disjoint core sets on CPU, stream limits on NPU);
- `E`, `P`, `D` are one worker each;
- `P+E` is one prefill worker whose engine encodes inline (mode P-D), handing KV to a D.
"""
from __future__ import annotations

from dataclasses import dataclass

from epdserve.engine.roles import FUSED_PREFILL, normalize_roles

MODES = ("monolithic", "P-D", "E-P-D", "EP-D", "ED-P", "E-PD")


def worker_roles(roles: str) -> list[str]:
    """The role of each stage worker an instance with `roles` runs."""
    roles = normalize_roles(roles)
    if roles in ("EPD", "PD", "E", "P", "D", FUSED_PREFILL):
        return [roles]
    return list(roles)  # EP → [E, P]; ED → [E, D]


@dataclass(frozen=True)
class Pool:
    """`count` instances that each run `roles`."""

    roles: str
    count: int


def mode_pools(mode: str, encode: int = 1, prefill: int = 1, decode: int = 1) -> list[Pool]:
    """Instance pools of a deployment mode, from the per-role counts.

    A co-located pool takes its count from its non-E role (EP-D: `prefill` EP instances) and
    `encode` beyond that adds E-only instances; monolithic runs `prefill` EPD instances and
    E-PD runs `prefill` PD instances.
    """
    for name, n in (("encode", encode), ("prefill", prefill), ("decode", decode)):
        if n < 0:
            raise ValueError(f"--{name} must be >= 0, got {n}")
    if mode == "monolithic":
        pools = [Pool("EPD", max(prefill, 1))]
    elif mode == "E-P-D":
        pools = [Pool("E", encode), Pool("P", prefill), Pool("D", decode)]
    elif mode == "EP-D":
        pools = [Pool("EP", prefill), Pool("E", max(0, encode - prefill)), Pool("D", decode)]
    elif mode == "ED-P":
        pools = [Pool("ED", decode), Pool("E", max(0, encode - decode)), Pool("P", prefill)]
    elif mode == "E-PD":
        pools = [Pool("E", encode), Pool("PD", prefill)]
    elif mode == "P-D":  # EPD-Serve's PD disaggregation: P encodes inline, no E instances
        pools = [Pool(FUSED_PREFILL, prefill), Pool("D", decode)]
    else:
        raise ValueError(f"mode must be one of {', '.join(MODES)}, got {mode!r}")
    pools = [p for p in pools if p.count > 0]
    have = "".join(p.roles for p in pools)
    missing = [r for r in "PD" if r not in have]
    if missing:
        raise ValueError(f"mode {mode} needs at least one instance with role(s) {', '.join(missing)}")
    return pools
