"""The torch / torch_npu pairs epdserve's NPU extras pin (setup.py extras_require: `npu`,
`npu-cann85`, `npu-cann83`), read from the installed package's metadata so that `doctor`'s fix
names the same exact pins: `torch-npu==2.9.0`, never `2.9.0.*`, which pip resolves to the newest
`.post` build, made for another CANN (Ascend/pytorch COMPATIBILITY.en.md, master: 2.9.0 is the
v2.9.0-7.3.0 branch for CANN 8.5.0, 2.9.0.post2 is v2.9.0-26.0.0 for CANN 9.0.0, 2.9.0.post6 is
v2.9.0-26.1.0 for CANN 9.1.0)."""
from __future__ import annotations

import importlib.metadata

from packaging.requirements import InvalidRequirement, Requirement


def extra_pins(dist: str = "epdserve") -> dict[str, dict[str, str]]:
    """{extra: {"torch": "2.9.0", "torch-npu": "2.9.0"}} for each extra pinning torch-npu exactly;
    {} when the package's metadata is not installed."""
    try:
        requires = importlib.metadata.requires(dist) or []
    except importlib.metadata.PackageNotFoundError:
        return {}
    pins: dict[str, dict[str, str]] = {}
    for line in requires:
        try:
            req = Requirement(line)
        except InvalidRequirement:
            continue
        name = req.name.lower().replace("_", "-")
        specs = list(req.specifier)
        if name not in ("torch", "torch-npu") or req.marker is None or len(specs) != 1 or specs[0].operator != "==":
            continue
        extra = _extra(str(req.marker))
        if extra:
            pins.setdefault(extra, {})[name] = specs[0].version
    return {extra: p for extra, p in pins.items() if "torch-npu" in p}


def _extra(marker: str) -> str | None:
    """'extra == "npu-cann85"' -> "npu-cann85"."""
    key, _, value = marker.partition("==")
    return value.strip().strip("\"'") if key.strip() == "extra" else None


def npu_fix(torch_release: str, dist: str = "epdserve") -> str:
    """The one-line fix for a missing or mismatched torch_npu next to torch `torch_release`."""
    pins = extra_pins(dist)
    for extra, p in sorted(pins.items()):
        if p.get("torch") == torch_release:
            return (f"pip install 'torch-npu=={p['torch-npu']}' (exactly, as the [{extra}] extra pins it; the README's "
                    "install table pairs torch, torch_npu and CANN)")
    if pins:
        lines = ", ".join(f"[{e}] torch {p.get('torch', '?')}" for e, p in sorted(pins.items()))
        return (f"no extra pairs torch_npu with torch {torch_release}: pip install 'epdserve[EXTRA]' for one of {lines} "
                "(exact torch and torch-npu pins; the README's install table pairs them with CANN)")
    return (f"pip install 'torch-npu=={torch_release}' (exactly: a .post build may be for another CANN; the README's "
            "install table pairs torch, torch_npu and CANN)")
