"""A container as the kubelet would start it: its environment (downward-API fields and Secret
keys filled in) and its argv (`$(VAR)` references expanded), for tests and for a harness that
runs a rendered pod as a local process.

`container_env(c, pod_ip=..., secrets=...)` resolves `value`, `fieldRef` (status.podIP,
metadata.name, ...) and `secretKeyRef` entries; `container_argv(c, env)` is command + args with
Kubernetes' expansion rule: `$(NAME)` becomes the variable's value when the container defines it,
`$$` is a literal `$`, and anything else is left as written.
"""
from __future__ import annotations

import re

_REF = re.compile(r"\$\$|\$\(([A-Za-z_][A-Za-z0-9_.-]*)\)")


def container_env(c: dict, fields: dict[str, str], secrets: dict[str, dict[str, str]]) -> dict[str, str]:
    """`fields`: fieldPath -> value (e.g. {"status.podIP": "127.0.0.2", "metadata.name": "p-0"});
    `secrets`: Secret name -> {key: value}. KeyError for a field or secret key not given."""
    env: dict[str, str] = {}
    for e in c.get("env", []):
        if "value" in e:
            env[e["name"]] = expand(e["value"], env)
        elif "fieldRef" in e.get("valueFrom", {}):
            env[e["name"]] = fields[e["valueFrom"]["fieldRef"]["fieldPath"]]
        elif "secretKeyRef" in e.get("valueFrom", {}):
            ref = e["valueFrom"]["secretKeyRef"]
            env[e["name"]] = secrets[ref["name"]][ref["key"]]
        else:
            raise ValueError(f"env {e['name']}: unsupported source {e.get('valueFrom')}")
    return env


def expand(word: str, env: dict[str, str]) -> str:
    def sub(m: re.Match) -> str:
        if m.group(0) == "$$":
            return "$"
        return env.get(m.group(1), m.group(0))
    return _REF.sub(sub, word)


def references(word: str) -> list[str]:
    """The variables `word` refers to as $(NAME)."""
    return [m.group(1) for m in _REF.finditer(word) if m.group(1)]


def container_argv(c: dict, env: dict[str, str]) -> list[str]:
    return [expand(w, env) for w in [*c.get("command", []), *c.get("args", [])]]
