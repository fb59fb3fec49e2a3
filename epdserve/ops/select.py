"""Which paged operators an engine uses: `paged_ops(platform)`; which fused LM-layer operators
its lean LM forward uses: `layer_ops(platform)`, chosen the same way.

`EPDSERVE_OPS=native|portable` chooses explicitly (native where there are no native operators,
the NPU's included, is an error, not a silent fallback). Unset: the NPU uses torch_npu's kernels;
the CPU uses the native csrc/ operators when they build, else the portable ones — saying so
once, with the reason; with `CI=true` a native build that fails raises instead (CI must never
go green on the fallback). CUDA has no native kernels yet: portable.
`layer_ops` on the NPU uses `epdserve.ops.npu_layer_ops.NpuLayerOps` (torch_npu's fused kernels)
where that module exists, else the portable torch ones.
"""
from __future__ import annotations

import logging
import os
from functools import lru_cache

from epdserve.ops.backend import PagedOps
from epdserve.ops.layer_ops import LayerOps, PortableLayerOps
from epdserve.ops.portable import PortableOps

log = logging.getLogger(__name__)

CHOICES = ("native", "portable")


class NativeOpsUnavailable(RuntimeError):
    """The native operators were asked for (or CI requires them) but cannot be built here."""


def _choice(choice: str | None) -> str:
    choice = (choice if choice is not None else os.environ.get("EPDSERVE_OPS", "")).strip().lower()
    if choice and choice not in CHOICES:
        raise ValueError(f"EPDSERVE_OPS must be one of {', '.join(CHOICES)}, got {choice!r}")
    return choice


def paged_ops(platform, choice: str | None = None) -> PagedOps:
    choice = _choice(choice)
    if choice == "portable":
        return PortableOps()
    if platform.name == "npu":
        if choice == "native":
            raise NativeOpsUnavailable("EPDSERVE_OPS=native: no native operators for npu (csrc/ has CPU kernels "
                                       "only); unset it to use torch_npu's kernels, or set it to portable")
        from epdserve.ops.npu_ops import NpuPagedOps

        return NpuPagedOps()
    if platform.name != "cpu":
        if choice == "native":
            raise NativeOpsUnavailable(f"no native operators for {platform.name} (csrc/ has CPU kernels only)")
        return PortableOps()
    ops, error = _native()
    if ops is not None:
        return ops
    if choice == "native" or os.environ.get("CI", "").lower() == "true":
        raise NativeOpsUnavailable(f"native operators could not be built: {error}")
    return PortableOps()


@lru_cache(maxsize=1)  # build once per process; the fallback is reported once
def _native():
    from epdserve.ops.native import load_native_ops

    try:
        return load_native_ops(), None
    except Exception as e:  # no compiler, no ninja, no csrc/: fall back, once, loudly
        log.warning("native paged operators unavailable (%s: %s); using the portable torch ones. "
                    "Run `epdserve build-ops` to see the build log.", type(e).__name__, e)
        return None, f"{type(e).__name__}: {e}"


def layer_ops(platform, choice: str | None = None) -> LayerOps:
    """The fused LM-layer operators (`LayerOps`) for `platform`, chosen as `paged_ops` chooses."""
    choice = _choice(choice)
    if choice == "portable":
        return PortableLayerOps()
    if platform.name == "npu":
        if choice == "native":
            raise NativeOpsUnavailable("EPDSERVE_OPS=native: no native layer operators for npu (csrc/ has CPU "
                                       "kernels only); unset it to use torch_npu's kernels, or set it to portable")
        from epdserve.ops.npu_layer_ops import NpuLayerOps

        return NpuLayerOps()
    if platform.name != "cpu":
        if choice == "native":
            raise NativeOpsUnavailable(f"no native layer operators for {platform.name} (csrc/ has CPU kernels only)")
        return PortableLayerOps()
    ops, error = _native_layer()
    if ops is not None:
        return ops
    if choice == "native" or os.environ.get("CI", "").lower() == "true":
        raise NativeOpsUnavailable(f"native layer operators could not be built: {error}")
    return PortableLayerOps()


@lru_cache(maxsize=1)  # build once per process; the fallback is reported once
def _native_layer():
    from epdserve.ops.native_layer_ops import load_native_layer_ops

    try:
        return load_native_layer_ops(), None
    except Exception as e:  # no compiler, no ninja, no csrc/: fall back, once, loudly
        log.warning("native layer operators unavailable (%s: %s); using the portable torch ones. "
                    "Run `epdserve build-ops` to see the build log.", type(e).__name__, e)
        return None, f"{type(e).__name__}: {e}"
