"""`NpuLayerOps`: the `LayerOps` contract (ops/layer_ops.py) over torch_npu's fused kernels.

Each call, its schema (the same on op-plugin 7.2.0, 7.3.0 and 26.1.0, op_plugin/config/
op_plugin_functions.yaml, and in the wheels: tests/fixtures/torch_npu/<line>.txt) and the
kernel's arithmetic as its source computes it:
- `npu_add_rms_norm(Tensor x1, Tensor x2, Tensor gamma, float epsilon=1e-06) -> (y, rstd, x)`:
  x = x1 + x2, y = RmsNorm(x) * gamma (hicann/ops-nn norm/add_rms_norm, README; op_kernel/
  add_rms_norm.h `KernelAddRmsNorm`: for bf16 the sum is taken in fp32 and written rounded as x,
  but normalised unrounded; y is rounded, widened, times gamma in fp32, rounded again — so
  `normed` may differ from transformers', which normalises the rounded sum, by one rounding of
  the sum). fp32 / fp16 / bf16; gamma of x's dtype, the shape of x's last dim.
- `npu_rms_norm(Tensor self, Tensor gamma, float epsilon=1e-06) -> (y, rstd)` (ops-nn
  norm/rms_norm, op_kernel/rms_norm.h `ComputeMulGammaCast`: x * rstd * gamma in fp32, rounded
  once; transformers rounds before the gamma product).
- `npu_rotary_mul(Tensor self, Tensor r1, Tensor r2, str rotary_mode='half'[, Tensor? rotate])
  -> Tensor`: x * r1 + rotate_half(x) * r2 (op-plugin torch_npu-npu_rotary_mul.md: 4-D input on
  7.2.0, 3-D (TND) also from 7.3.0; layouts BNSD / BSND / SBND, r1/r2 `1S1D` for BSND; D even and
  < 896, B and N < 1000; fp16 / bf16 / fp32; ops-transformer posembedding/
  rotary_position_embedding/op_kernel/rotate_half_bf16.h: fp32 inside, rounded once). Called as
  BSND with B = 1 ([1, T, H, d], cos/sin [1, T, 1, d]), which every line takes; the kernel writes a
  new tensor. `npu_apply_rotary_pos_emb` (q and k in place, one call) is not used: its layout
  default changed from 'BSH' (7.2.0 / 7.3.0 / 26.0.0) to 'BSND' (26.1.0), and its shape rules were
  not read here.
- `npu_swiglu(Tensor self, int dim=-1) -> Tensor`: Swish(A) * B, A and B the halves of x along
  dim (ops-nn activation/swi_glu README; op_kernel/swi_glu_bf16.hpp: both halves widened to fp32,
  a / (1 + exp(-a)) * b, rounded once).

`npu_rotary_mul`'s r1 / r2 are documented for the range [-1, 1] (op-plugin
docs/context/torch_npu-npu_rotary_mul.md, 约束说明: "r1、r2：数据范围：[-1, 1]"): a model whose
rotary tables leave it (a rope `attention_scaling` above 1, `rotary_range`) takes the portable
rotary, said once.

Where a kernel does not fit — an operator the installed torch_npu does not register (read once
from the schemas, ops/npu_schema.py `op_arguments`), a dtype it does not take, gamma of another
dtype, a head_dim of 896 or more or odd, 1000 heads or more — the call goes to `PortableLayerOps`.
Not measured on an NPU here: the kernels' numbers against transformers are tested on the fake
torch_npu, which computes as the sources above do.
"""
from __future__ import annotations

import logging

import torch

from epdserve.ops.layer_ops import LayerOps, PortableLayerOps
from epdserve.ops.npu_schema import op_arguments

log = logging.getLogger(__name__)
KERNELS = ("npu_add_rms_norm", "npu_rms_norm", "npu_rotary_mul", "npu_swiglu")
_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
_ROTARY_MAX_D, _ROTARY_MAX_HEADS = 896, 1000  # torch_npu-npu_rotary_mul.md: D < 896 and even; B, N < 1000


class NpuLayerOps(LayerOps):
    name = "npu"

    def __init__(self):
        import torch_npu  # registers the npu:: operators read below

        self._npu = torch_npu
        self._has = {k: op_arguments("npu", k) is not None for k in KERNELS}
        self._portable = PortableLayerOps()
        self._rotary_in_range = True  # the rotary tables within npu_rotary_mul's documented [-1, 1]

    def rotary_range(self, max_abs: float) -> None:
        if max_abs > 1.0 and self._rotary_in_range:
            self._rotary_in_range = False
            log.warning("rotary tables reach %.3g, outside npu_rotary_mul's documented [-1, 1] (the rope's "
                        "attention scaling): rotary runs as portable torch ops", max_abs)

    @property
    def kernels(self) -> tuple[str, ...]:
        """The fused kernels this torch_npu registers (the others' calls are portable)."""
        return tuple(k for k in KERNELS if self._has[k])

    def add_rms_norm(self, x, residual, weight, eps):
        if residual is None:
            return self.rms_norm(x, weight, eps), x
        if not (self._has["npu_add_rms_norm"] and _norm_fits(x, weight) and residual.dtype == x.dtype
                and residual.shape == x.shape):
            return self._portable.add_rms_norm(x, residual, weight, eps)
        y, _, summed = self._npu.npu_add_rms_norm(residual, x, weight, float(eps))
        return y, summed

    def rms_norm(self, x, weight, eps):
        if not (self._has["npu_rms_norm"] and _norm_fits(x, weight)):
            return self._portable.rms_norm(x, weight, eps)
        y, _ = self._npu.npu_rms_norm(x, weight, float(eps))
        return y

    def rotary(self, q, k, cos, sin):
        d = q.shape[-1]
        if not (self._has["npu_rotary_mul"] and self._rotary_in_range and q.dtype in _DTYPES and k.dtype == q.dtype and d % 2 == 0
                and d < _ROTARY_MAX_D and max(q.shape[1], k.shape[1]) < _ROTARY_MAX_HEADS):
            return self._portable.rotary(q, k, cos, sin)
        c = cos.to(q.dtype).reshape(1, cos.shape[0], 1, d).contiguous()  # BSND's "1S1D"
        s = sin.to(q.dtype).reshape(1, sin.shape[0], 1, d).contiguous()
        rq = self._npu.npu_rotary_mul(q.contiguous().unsqueeze(0), c, s)
        rk = self._npu.npu_rotary_mul(k.contiguous().unsqueeze(0), c, s)
        return rq.squeeze(0), rk.squeeze(0)

    def silu_and_mul(self, x):
        if not (self._has["npu_swiglu"] and x.dtype in _DTYPES and x.shape[-1] % 2 == 0):
            return self._portable.silu_and_mul(x)
        return self._npu.npu_swiglu(x.contiguous(), -1)


def _norm_fits(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """AddRmsNorm / RmsNorm: fp32 / fp16 / bf16, gamma of x's dtype over x's last dim."""
    return x.dtype in _DTYPES and weight.dtype == x.dtype and weight.dim() == 1 and weight.shape[0] == x.shape[-1]
