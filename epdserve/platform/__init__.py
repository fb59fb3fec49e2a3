"""Platform registry: picks cpu | cuda | npu and hands out the matching `Platform` object.

Device-specific modules are imported lazily, so torch_npu is imported only when the npu
platform is asked for (or probed by `device="auto"`).

One sentence per module:
- base.py   the `Platform` contract: device handle, dist backend and pair groups, streams, core limits
- cpu.py    CPU: gloo pair groups for KV transfer, and how to interrupt one
- cores.py  the CPU cores this process may use and their split into disjoint sets
- dtype_default.py  what `--dtype auto` means here (bf16 on accelerators and CPUs with native bf16) and why
- cuda.py   CUDA: NCCL for KV transfer, one CUDA stream per co-located stage
- npu.py    Ascend NPU: device, HCCL, streams and core limits (torch_npu imported lazily)
- npu_versions.py  the driver / CANN / torch_npu table (Ascend/pytorch COMPATIBILITY.en.md) and the check of a host against it
- npu_graphs.py   whether the installed torch_npu can capture NPU decode graphs (and why not), and the capture
- npu_streams.py  NpuStreamBook: NPU streams of ours, never aliasing each other or HCCL's (torch_npu's pools)
"""
from __future__ import annotations

import importlib
import logging
from functools import lru_cache
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # base.py imports torch; the package itself must not (platform/cores.py serves --help paths)
    from epdserve.platform.base import Platform


log = logging.getLogger(__name__)

_MODULES = {"cpu": "epdserve.platform.cpu", "cuda": "epdserve.platform.cuda", "npu": "epdserve.platform.npu"}


def get_platform(device: str = "auto") -> Platform:
    """Return the platform for `device` ("auto", "cpu", "cuda", "npu", or "cuda:1"-style)."""
    kind = device.split(":")[0]
    if kind == "auto":
        for name in ("npu", "cuda"):
            plat = _load(name)
            reason = plat.unavailable_reason()
            if reason is None:
                return plat
            if name == "npu" and importlib.import_module(_MODULES["npu"]).torch_npu_installed():
                _warn_once(f"torch_npu is installed but the NPU cannot be used, running on another device: {reason}")
        return _load("cpu")
    if kind not in _MODULES:
        raise ValueError(f"unknown device {device!r}; expected one of auto, cpu, cuda, npu")
    plat = _load(kind)
    reason = plat.unavailable_reason()
    if reason is not None:
        raise RuntimeError(f"device {device!r} requested but not available on this machine: {reason}")
    return plat


def resolve_device(device: str) -> str:
    """`device` with "auto" replaced by the platform it picks ("npu", "cuda" or "cpu"); others unchanged."""
    return get_platform("auto").name if device.split(":")[0] == "auto" else device


@lru_cache(maxsize=None)  # one warning per distinct reason and process
def _warn_once(message: str) -> None:
    log.warning(message)


def _load(name: str) -> Platform:
    return importlib.import_module(_MODULES[name]).PLATFORM


__all__ = ["Platform", "get_platform", "resolve_device"]
