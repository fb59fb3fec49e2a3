"""Which stage workers an instance hosts for its `--roles` (the modes that use them: instance/modes.py).

Roles (parsed by `epdserve.engine.roles.normalize_roles`) → workers:
- `EPD` is one coupled engine (monolithic): encode, prefill and decode in one step loop;
- `PD` is one coupled engine doing prefill + decode with continuous batching (mode E-PD);
- `EP` and `ED` are two co-located workers (E + P, E + D), each with its own queue, engine and
  loop thread, splitting the device (disjoint core sets on CPU, stream limits on NPU);
- `E`, `P`, `D` are one worker each;
- `P+E` is one prefill worker whose engine encodes inline (mode P-D), handing KV to a D.
"""
from __future__ import annotations

from epdserve.engine.roles import FUSED_PREFILL, normalize_roles


def worker_roles(roles: str) -> list[str]:
    """The role of each stage worker an instance with `roles` runs."""
    roles = normalize_roles(roles)
    if roles in ("EPD", "PD", "E", "P", "D", FUSED_PREFILL):
        return [roles]
    return list(roles)  # EP → [E, P]; ED → [E, D]
