"""The quantized-matmul kernels engine/lm/npu_quant_linear.py and npu_static_w8a8.py call, for the
fake torch_npu: each computes what op-plugin's documentation says it computes, in torch on the CPU,
and refuses what that documentation (Atlas A2 / A3 rows) refuses. Tests only. Sources (op-plugin
master 517f2e7, docs/zh/custom_APIs/torch_npu/):
- torch_npu-npu_weight_quant_batchmatmul.md: y = x @ ANTIQUANT(weight) + bias, ANTIQUANT(weight) =
  (weight + antiquant_offset) * antiquant_scale; x fp16 / bf16 (M, K); weight int8 (K, N), a
  transposed view allowed; antiquant_scale of x's dtype, (N,) or (1, N) per channel, (1,) per
  tensor; antiquant_offset of its shape and dtype; bias (N,): fp32 for bf16 x, fp16 for fp16 x;
  K and N in [1, 65535]; no quant_scale here (the output stays in x's dtype); an int32 weight
  carrying int4 (K, N / 8) with pergroup scale / offset: tests/fakes/npu_int4_kernels_fake.py. The precision of the
  antiquant step is not documented: modelled as the dequantized weight rounded to x's dtype, the
  product accumulated in fp32 and rounded once.
- torch_npu-npu_dynamic_quant.md: per row scale = rowMax(|x|) / 127 (fp32, shape x.shape[:-1]),
  y = round(x / scale) (int8); x fp16 / bf16 with more than one dim. "round" is not qualified
  there: modelled as half to even (torch.round); a zero row (scale 0) gives zeros.
- torch_npu-npu_quantize.md: div_mode False: input * scales + zero_points, div_mode True: input /
  scales + zero_points; dtype qint8 -> an int8 tensor, saturated to [-128, 127]; with div_mode
  False, scales and zero_points of input's dtype, 1-D of the quantized axis' size or 1. Computed
  in fp32, rounded half to even.
- torch_npu-npu_quant_matmul.md: int32 bias: out = (x1 @ x2 + bias) * scale; float bias: out =
  x1 @ x2 * scale + bias; pertoken_scale (m,) fp32 scales each row; x1 / x2 int8, x2 (k, n); scale
  1-D (1,) or (n,); the dtype rows of its table 2 (A2 / A3) for int8 inputs; k <= 65535. The int8
  products are summed exactly (int32), then scaled in fp32 and rounded once to output_dtype.
The dtype arguments are `int` on 26.1.0 and `ScalarType` on 7.2.0 / 7.3.0; either way torch binds a
torch.dtype as its ScalarType number (tests/fakes/npu_kernels_fake.py `bind`, `dtype_of`).
"""
from __future__ import annotations

import torch

from tests.fakes.npu_int4_kernels_fake import check_group, convert_weight_to_int4pack, grouped, unpack_int4
from tests.fakes.npu_kernels_fake import dtype_of

_HALF = (torch.float16, torch.bfloat16)
_MAX_KN = 65535


def _require(cond, msg):
    if not cond:
        raise RuntimeError(msg)  # what a failed aclnn parameter check surfaces as


def weight_quant_batchmatmul(a: dict) -> torch.Tensor:
    x, w, scale, offset, bias = a["x"], a["weight"], a["antiquant_scale"], a["antiquant_offset"], a["bias"]
    group = a["antiquant_group_size"]
    _require(x.dtype in _HALF and x.dim() == 2, "x: fp16 / bf16, (M, K)")
    _require(w.dtype in (torch.int8, torch.int32) and w.dim() == 2 and w.shape[0] == x.shape[1],
             "weight: int8 (K, N), or int32 carrying int4 (K, N / 8)")
    wv = unpack_int4(w) if w.dtype == torch.int32 else w
    k, n = wv.shape
    _require(1 <= k <= _MAX_KN and 1 <= n <= _MAX_KN, f"K, N in [1, 65535], got {k}, {n}")
    _require(a["quant_scale"] is None and a["quant_offset"] is None, "stand-in covers antiquant without an output quant")
    _require(scale.dtype == x.dtype, "antiquant_scale: x's dtype")
    if group:
        check_group(scale, offset, group, k, n)
    else:
        _require(scale.numel() in (1, n) and scale.dim() <= 2, "antiquant_scale: (N,), (1, N) or (1,)")
        _require(offset is None or (offset.dtype == scale.dtype and offset.shape == scale.shape),
                 "antiquant_offset: antiquant_scale's shape and dtype")
    if bias is not None:
        want = torch.float32 if x.dtype == torch.bfloat16 else torch.float16
        _require(bias.dtype == want and bias.numel() == n and bias.is_contiguous(), f"bias: {want} (N,) for {x.dtype} x")
    per_row = (lambda t: grouped(t, group, k)) if group else (lambda t: t.float().reshape(1, -1))
    wf = wv.float() + (per_row(offset) if offset is not None else 0.0)
    deq = (wf * per_row(scale)).to(x.dtype)
    out = x.float() @ deq.float()
    return (out + bias.float() if bias is not None else out).to(x.dtype)


def dynamic_quant(a: dict):
    x = a["input"]
    _require(x.dtype in _HALF and x.dim() > 1, "x: fp16 / bf16, more than one dim")
    _require(a["smooth_scales"] is None and a["group_index"] is None, "stand-in covers no smooth_scales")
    _require(dtype_of(a["dst_type"]) in (None, torch.int8), "stand-in covers dst_type int8")
    _require(a.get("quant_mode", "pertoken") == "pertoken" and a.get("dst_type_max", 0.0) == 0.0,
             "stand-in covers quant_mode 'pertoken'")
    x32 = x.float()
    scale = x32.abs().amax(dim=-1) / 127.0
    safe = torch.where(scale > 0, scale, torch.ones_like(scale))
    y = torch.round(x32 / safe.unsqueeze(-1)).clamp_(-128, 127)
    return y.to(torch.int8), scale


def quantize(a: dict) -> torch.Tensor:
    x, scales, zp, axis = a["self"], a["scales"], a["zero_points"], a["axis"]
    _require(dtype_of(a["dtype"]) == torch.qint8, "stand-in covers dtype qint8")
    _require(x.dtype in (torch.float32, *_HALF), "input: fp32 / fp16 / bf16")
    dim = x.dim() - 2 if axis == -2 else x.dim() - 1 if (not a["div_mode"] and axis > -2) else axis
    if not a["div_mode"]:
        _require(scales.dtype == x.dtype and (zp is None or zp.dtype == x.dtype),
                 "div_mode False: scales / zero_points of input's dtype")
    _require(scales.dim() == 1 and scales.shape[0] in (1, x.shape[dim]), "scales: 1-D, the axis' size or 1")
    shape = [1] * x.dim()
    shape[dim] = scales.shape[0]
    s = scales.float().reshape(shape)
    y = x.float() * s if not a["div_mode"] else x.float() / s
    if zp is not None:
        y = y + zp.float().reshape(shape)
    return torch.round(y).clamp_(-128, 127).to(torch.int8)


def quant_matmul(a: dict) -> torch.Tensor:
    x1, x2, scale, bias, pertoken = a["x1"], a["x2"], a["scale"], a["bias"], a["pertoken_scale"]
    out_dtype = dtype_of(a["output_dtype"])
    _require(x1.dtype == x2.dtype == torch.int8 and x1.dim() == x2.dim() == 2, "stand-in covers int8 (m, k) @ (k, n)")
    m, k = x1.shape
    _require(x2.shape[0] == k and k <= _MAX_KN, f"x2: (k, n) with k = {k} <= 65535")
    n = x2.shape[1]
    _require(a["offset"] is None and a["group_sizes"] is None, "stand-in covers no offset / group_sizes")
    _require(scale.dim() == 1 and scale.shape[0] in (1, n), "scale: (1,) or (n,)")
    _require(pertoken is None or (pertoken.dtype == torch.float32 and tuple(pertoken.shape) == (m,)),
             "pertoken_scale: fp32 (m,)")
    _require(bias is None or (bias.dim() == 1 and bias.shape[0] == n), "bias: (n,)")
    _require(_table2(out_dtype, scale.dtype, None if bias is None else bias.dtype, pertoken is not None),
             f"no table-2 row for output {out_dtype}, scale {scale.dtype}, bias "
             f"{None if bias is None else bias.dtype}, pertoken_scale {pertoken is not None}")
    acc = x1.to(torch.int64) @ x2.to(torch.int64)  # exact: |sum| < 2^31 for k <= 65535
    if bias is not None and bias.dtype == torch.int32:
        acc = acc + bias.to(torch.int64)
    out = acc.to(torch.float32) * scale.float()
    if pertoken is not None:
        out = out * pertoken.unsqueeze(-1)
    if bias is not None and bias.dtype != torch.int32:
        out = out + bias.float()
    return out.to(out_dtype)


def _table2(out, scale, bias, pertoken: bool) -> bool:
    """torch_npu-npu_quant_matmul.md table 2 (A2 / A3), the int8 x1 / x2 rows with a float output."""
    if out == torch.bfloat16:
        return scale in (torch.float32, torch.bfloat16) and bias in (None, torch.int32, torch.bfloat16, torch.float32)
    if out == torch.float16 and pertoken:
        return scale == torch.float32 and bias in (None, torch.int32, torch.bfloat16, torch.float32)
    if out == torch.float16:
        return scale in (torch.int64, torch.float32) and bias in (None, torch.int32)
    return False


QUANT_KERNELS = {"npu_weight_quant_batchmatmul": weight_quant_batchmatmul, "npu_dynamic_quant": dynamic_quant,
                 "npu_quantize": quantize, "npu_quant_matmul": quant_matmul,
                 "npu_convert_weight_to_int4pack": convert_weight_to_int4pack}
