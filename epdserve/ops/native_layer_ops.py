"""`NativeLayerOps`: an LM layer's fused element-wise operators as csrc/ C++ kernels (CPU).

Each method dispatches exactly one operator (`torch.ops.epdserve.*`, csrc/cpu/layer_ops.cpp),
where the portable torch form dispatches 5-14: that is what brings a lean layer's decode step
under the issue-36 bound of 25 operators. The arithmetic is torch's eager arithmetic in the
tensors' dtype (float32, bfloat16, float16), op for op: on x86 the norms and the rotary equal
`PortableLayerOps` bit for bit, and silu-and-mul too but for the few elements torch leaves to
std::exp (one bf16 ulp at most; tests/ops/test_layer_ops.py says where and why).
`weight`, `cos` and `sin` must have the activations' dtype (the model's, as transformers loads
them); float64 is not supported.

In place, as the `LayerOps` contract allows: `add_rms_norm` writes the normed value into `x` and
the sum into `residual` and returns those two tensors; `rotary` rotates `q` and `k` where they
lie (views into a fused QKV output included) and returns them.

Shape functions ("fake" kernels) are registered here, so the operators trace under
torch.compile / FakeTensor and pass `torch.library.opcheck`.
"""
from __future__ import annotations

from functools import lru_cache

import torch

from epdserve.ops.layer_ops import LayerOps
from epdserve.ops.native_build import build_and_load


def load_native_layer_ops() -> "NativeLayerOps":
    """Build/load the library (cached) and return the operators; raises if they cannot be built."""
    build_and_load()
    _register_fakes()
    return NativeLayerOps()


@lru_cache(maxsize=None)  # registering twice would raise: once per process, like the library itself
def _register_fakes() -> tuple:

    def fused_add_rms_norm(x, residual, weight, eps):
        return None

    def rms_norm(x, weight, eps):
        return x.new_empty(x.shape)

    def rotary_embedding(q, k, cos, sin):
        return None

    def silu_and_mul(x):
        return x.new_empty((*x.shape[:-1], x.shape[-1] // 2))

    return tuple(torch.library.register_fake(f"epdserve::{fn.__name__}", fn)
                 for fn in (fused_add_rms_norm, rms_norm, rotary_embedding, silu_and_mul))


class NativeLayerOps(LayerOps):
    """The `LayerOps` contract over the csrc/ CPU kernels (stateless; build with
    `load_native_layer_ops()`, which loads the library first)."""

    name = "native"

    def __init__(self) -> None:
        ops = torch.ops.epdserve  # bound once: the per-call attribute lookups cost more than the kernels at decode
        self._add_norm = ops.fused_add_rms_norm.default
        self._norm = ops.rms_norm.default
        self._rotary = ops.rotary_embedding.default
        self._silu_mul = ops.silu_and_mul.default

    def add_rms_norm(self, x, residual, weight, eps):
        if residual is None:
            return self._norm(x, weight, eps), x
        self._add_norm(x, residual, weight, eps)
        return x, residual

    def rms_norm(self, x, weight, eps):
        return self._norm(x, weight, eps)

    def rotary(self, q, k, cos, sin):
        self._rotary(q, k, cos, sin)
        return q, k

    def silu_and_mul(self, x):
        return self._silu_mul(x)
