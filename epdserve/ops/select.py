"""Which paged operators an engine uses: `paged_ops(platform)`; which fused LM-layer operators
its lean LM forward uses: `layer_ops(platform)`, chosen the same way.

The choice is the caller's (`EngineConfig.ops`, which `EPDSERVE_OPS=native|portable` sets when
not given: declared there, read nowhere else): native where there are no native operators, the
NPU's included, is an error, not a silent fallback. Unset: the NPU uses torch_npu's kernels;
the CPU uses the native csrc/ operators when they build, else the portable ones — saying so
once, with the reason; with `CI=true` a native build that fails raises instead (CI must never
go green on the fallback). CUDA's paged operators are `TritonOps` (decode attention as a Triton
kernel, the KV write as one more; ops/triton_ops.py) when Triton imports, else the portable ones,
saying so once; its layer operators likewise: `TritonLayerOps` (ops/triton_layer_ops.py) when
Triton imports, else the portable ones, said once.
`layer_ops` on the NPU uses `epdserve.ops.npu_layer_ops.NpuLayerOps` (torch_npu's fused kernels).
"""
from __future__ import annotations

import logging
import os
from dataclasses import dataclass
from functools import lru_cache
from typing import Callable

from epdserve.ops.backend import PagedOps
from epdserve.ops.layer_ops import LayerOps, PortableLayerOps
from epdserve.ops.portable import PortableOps

log = logging.getLogger(__name__)

CHOICES = ("native", "portable")


class NativeOpsUnavailable(RuntimeError):
    """The native operators were asked for (or CI requires them) but cannot be built here."""


def _choice(choice: str | None) -> str:
    choice = (choice or "").strip().lower()
    if choice and choice not in CHOICES:
        raise ValueError(f"ops must be one of {', '.join(CHOICES)}, got {choice!r}")
    return choice


@dataclass(frozen=True)
class _Family:
    """One family of operators: what each platform gets."""

    what: str  # for messages: "operators", "layer operators"
    portable: Callable[[], object]
    npu: Callable[[], object]  # torch_npu's kernels, imported lazily
    native: Callable[[], object]  # builds / loads csrc/ (raises when it cannot)
    cuda: Callable[[], object] | None = None  # CUDA's own, else the portable ones


def _npu_paged():
    from epdserve.ops.npu_ops import NpuPagedOps

    return NpuPagedOps()


def _npu_layer():
    from epdserve.ops.npu_layer_ops import NpuLayerOps

    return NpuLayerOps()


def _native_paged():
    from epdserve.ops.native import load_native_ops

    return load_native_ops()


def _native_layer():
    from epdserve.ops.native_layer_ops import load_native_layer_ops

    return load_native_layer_ops()


def _cuda_paged():
    try:
        from epdserve.ops.triton_ops import TritonOps

        return TritonOps()
    except ImportError as e:  # no Triton in this environment: the portable operators, said once
        _warn_once(f"Triton unavailable ({e}); CUDA decode attention uses the portable gather + SDPA")
        return PortableOps()


def _cuda_layer():
    try:
        from epdserve.ops.triton_layer_ops import TritonLayerOps

        return TritonLayerOps()
    except ImportError as e:  # no Triton: the portable torch ops, said once
        _warn_once(f"Triton unavailable ({e}); CUDA's layer operators are the portable torch ones")
        return PortableLayerOps()


@lru_cache(maxsize=None)
def _warn_once(message: str) -> None:
    log.warning("%s", message)


PAGED = _Family("paged operators", PortableOps, _npu_paged, _native_paged, _cuda_paged)
LAYER = _Family("layer operators", PortableLayerOps, _npu_layer, _native_layer, _cuda_layer)


def paged_ops(platform, choice: str | None = None) -> PagedOps:
    """The paged-KV attention operators (`PagedOps`) for `platform`."""
    return _select(PAGED, platform, choice)


def layer_ops(platform, choice: str | None = None) -> LayerOps:
    """The fused LM-layer operators (`LayerOps`) for `platform`, chosen as `paged_ops` chooses."""
    return _select(LAYER, platform, choice)


def _select(family: _Family, platform, choice: str | None):
    choice = _choice(choice)
    if choice == "portable":
        return family.portable()
    if platform.name == "npu":
        if choice == "native":
            raise NativeOpsUnavailable(f"EPDSERVE_OPS=native: no native {family.what} for npu (csrc/ has CPU "
                                       "kernels only); unset it to use torch_npu's kernels, or set it to portable")
        return family.npu()
    if platform.name != "cpu":
        if choice == "native":
            raise NativeOpsUnavailable(f"no native {family.what} for {platform.name} (csrc/ has CPU kernels only)")
        return family.cuda() if platform.name == "cuda" and family.cuda is not None else family.portable()
    ops, error = _built(family)
    if ops is not None:
        return ops
    if choice == "native" or os.environ.get("CI", "").lower() == "true":
        raise NativeOpsUnavailable(f"native {family.what} could not be built: {error}")
    return family.portable()


@lru_cache(maxsize=None)  # build once per process and family; the fallback is reported once
def _built(family: _Family):
    try:
        return family.native(), None
    except Exception as e:  # no compiler, no ninja, no csrc/: fall back, once, loudly
        log.warning("native %s unavailable (%s: %s); using the portable torch ones. "
                    "Run `epdserve build-ops` to see the build log.", family.what, type(e).__name__, e)
        return None, f"{type(e).__name__}: {e}"
