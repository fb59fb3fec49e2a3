"""Platform registry: picks cpu | cuda | npu and hands out the matching `Platform` object.

Device-specific modules are imported lazily, so torch_npu is imported only when the npu
platform is asked for (or probed by `device="auto"`).
"""
from __future__ import annotations

import importlib

from epdserve.platform.base import Platform

_MODULES = {"cpu": "epdserve.platform.cpu", "cuda": "epdserve.platform.cuda", "npu": "epdserve.platform.npu"}


def get_platform(device: str = "auto") -> Platform:
    """Return the platform for `device` ("auto", "cpu", "cuda", "npu", or "cuda:1"-style)."""
    kind = device.split(":")[0]
    if kind == "auto":
        for name in ("npu", "cuda"):
            plat = _load(name)
            if plat.is_available():
                return plat
        return _load("cpu")
    if kind not in _MODULES:
        raise ValueError(f"unknown device {device!r}; expected one of auto, cpu, cuda, npu")
    plat = _load(kind)
    if not plat.is_available():
        raise RuntimeError(f"device {device!r} requested but not available on this machine")
    return plat


def _load(name: str) -> Platform:
    return importlib.import_module(_MODULES[name]).PLATFORM


__all__ = ["Platform", "get_platform"]
