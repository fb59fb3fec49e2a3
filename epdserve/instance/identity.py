"""An instance's identity on the roster: opaque (``<roles>-<random>``, e.g. ``PD-3f9a1c2b``).

Ids travel where addresses must not — logs, `/metrics` labels, `GetServerInfo` for callers
without the cluster token — so they never embed a host or port; an operator's --instance-id is
used as given.
"""
from __future__ import annotations

import secrets


def opaque_instance_id(roles: str) -> str:
    return f"{roles}-{secrets.token_hex(4)}"
