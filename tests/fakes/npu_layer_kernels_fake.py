"""The fused layer kernels ops/npu_layer_ops.py calls, for the fake torch_npu, computed as their
sources compute them (dtype by dtype: where the kernel widens to fp32 and where it rounds) and
refusing what their documentation refuses. Tests only. Sources:
- npu_add_rms_norm: hicann/ops-nn (e5c3fa9) norm/add_rms_norm/op_kernel/add_rms_norm.h
  `KernelAddRmsNorm`: fp16 adds in fp16; bf16 widens both inputs, adds in fp32, writes the sum
  rounded (CAST_RINT) but normalises the fp32 sum; y = rint(x * rstd), widened, * gamma in fp32,
  rint again (bf16); fp16: rint(x * rstd) * gamma in fp16; fp32 throughout for fp32;
- npu_rms_norm: norm/rms_norm/op_kernel/rms_norm.h `ComputeMulGammaCast`: x * rstd * gamma in
  fp32, one rounding;
- npu_rotary_mul: hicann/ops-transformer (c29bc10) posembedding/rotary_position_embedding/
  op_kernel/rotate_half_bf16.h: x, cos, sin widened to fp32, x * cos + rotate_half(x) * sin,
  one rounding (CAST_RINT); op-plugin torch_npu-npu_rotary_mul.md: 4-D input on 7.2.0 (3-D TND
  too from 7.3.0), D even and < 896, N < 1000, r1 / r2 of the input's dtype;
- npu_swiglu: ops-nn activation/swi_glu/op_kernel/swi_glu_bf16.hpp: both halves widened,
  a / (1 + exp(-a)) * b in fp32, one rounding.
"""
from __future__ import annotations

import torch

_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


def _require(cond, msg):
    if not cond:
        raise RuntimeError(msg)


def _rstd(x32: torch.Tensor, eps: float) -> torch.Tensor:
    return torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)


def _check_norm(x, gamma):
    _require(x.dtype in _DTYPES, f"RmsNorm: dtype {x.dtype}")
    _require(gamma.dtype == x.dtype and tuple(gamma.shape) == tuple(x.shape[-gamma.dim():]),
             "gamma: x's dtype, the shape of x's last dims")


def add_rms_norm(a: dict):
    x1, x2, gamma, eps = a["x1"], a["x2"], a["gamma"], a["epsilon"]
    _check_norm(x1, gamma)
    _require(x2.dtype == x1.dtype and x2.shape == x1.shape, "x1 / x2: one dtype and shape")
    dt = x1.dtype
    if dt == torch.float16:
        x = x1 + x2  # Add in half
        s = x.float()
    else:
        s = x1.float() + x2.float()
        x = s.to(dt)  # bf16: written rounded; the norm goes on with the fp32 sum
    rstd = _rstd(s, eps)
    if dt == torch.bfloat16:
        y = ((s * rstd).to(dt).float() * gamma.float()).to(dt)
    elif dt == torch.float16:
        y = (s * rstd).to(dt) * gamma
    else:
        y = s * rstd * gamma
    return y, rstd, x


def rms_norm(a: dict):
    x, gamma, eps = a["self"], a["gamma"], a["epsilon"]
    _check_norm(x, gamma)
    x32 = x.float()
    rstd = _rstd(x32, eps)
    return (x32 * rstd * gamma.float()).to(x.dtype), rstd


def rotary_mul(a: dict, *, three_d: bool):
    x, r1, r2, mode = a["self"], a["r1"], a["r2"], a["rotary_mode"]
    _require(mode == "half", "stand-in covers rotary_mode 'half'")
    _require(x.dim() == 4 or (three_d and x.dim() == 3), f"input must be 4-D{' or 3-D' if three_d else ''}")
    _require(x.dtype in _DTYPES and r1.dtype == r2.dtype == x.dtype, "x, r1, r2: one dtype")
    d = x.shape[-1]
    _require(d % 2 == 0 and d < 896, f"D must be even and < 896, got {d}")
    _require(x.shape[-2] < 1000, "N must be < 1000")
    x32, c, s = x.float(), r1.float(), r2.float()
    h = d // 2
    rot = torch.cat((-x32[..., h:], x32[..., :h]), dim=-1)
    return (x32 * c + rot * s).to(x.dtype)


def swiglu(a: dict):
    x, dim = a["self"], a["dim"]
    _require(x.dtype in _DTYPES and x.shape[dim] % 2 == 0, "SwiGlu: fp32/fp16/bf16, an even split dim")
    g, u = x.float().chunk(2, dim=dim)
    return (g / (1 + torch.exp(-g)) * u).to(x.dtype)


def layer_kernels(line: str) -> dict:
    """{operator: impl} for one torch_npu line (npu_rotary_mul takes 3-D input from 7.3.0 on)."""
    three_d = line != "2.8.0"
    return {"npu_add_rms_norm": add_rms_norm, "npu_rms_norm": rms_norm, "npu_swiglu": swiglu,
            "npu_rotary_mul": lambda a: rotary_mul(a, three_d=three_d)}
