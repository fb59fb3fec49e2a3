"""Which paged operators an engine uses: `paged_ops(platform)`.

`EPDSERVE_OPS=native|portable` chooses explicitly (native where there are no native operators,
the NPU's included, is an error, not a silent fallback). Unset: the NPU uses torch_npu's kernels;
the CPU uses the native csrc/ operators when they build, else the portable ones — saying so
once, with the reason; with `CI=true` a native build that fails raises instead (CI must never
go green on the fallback). CUDA has no native kernels yet: portable.
"""
from __future__ import annotations

import logging
import os
from functools import lru_cache

from epdserve.ops.backend import PagedOps
from epdserve.ops.portable import PortableOps

log = logging.getLogger(__name__)

CHOICES = ("native", "portable")


class NativeOpsUnavailable(RuntimeError):
    """The native operators were asked for (or CI requires them) but cannot be built here."""


def paged_ops(platform, choice: str | None = None) -> PagedOps:
    choice = (choice if choice is not None else os.environ.get("EPDSERVE_OPS", "")).strip().lower()
    if choice and choice not in CHOICES:
        raise ValueError(f"EPDSERVE_OPS must be one of {', '.join(CHOICES)}, got {choice!r}")
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


def layer_ops(platform, choice: str | None = None):
    """The fused layer operators (ops/layer_ops.py) of this platform (portable until the native
    and NPU ones land)."""
    from epdserve.ops.layer_ops import PortableLayerOps

    return PortableLayerOps()
