"""Quantized projections of the linear-layer contract (engine/lm/linear.py), quantized from the
checkpoint's weights at load: int8 weight-only (W8A16, `--quantization int8`) and int8 weights
with dynamic per-token int8 activations (W8A8, `--quantization w8a8`).

`Int8Linear` holds each output channel's weights as int8 with one scale per channel, symmetric:
scale = max|w| / 127 over the channel's inputs (rounded to the model dtype), q = round(w / scale)
clamped to [-127, 127]
(`quantize_int8`; `dequantize_int8` is its inverse, q · scale, the weights the engine in effect
computes with — the tests' oracle checkpoint holds exactly those). Activations, the KV cache and
the output stay in the model dtype. Fused parts (QKV's three, gate-up's two) are quantized per
output channel, so fusing changes nothing. Held as torch's CPU kernel wants them: q [out, in]
row-major int8, scales [out] in the model dtype.

Applied two ways, by the number of rows (tokens) in the call, because torch's
`_weight_int8pack_mm` (aten/src/ATen/native/cpu/int8mm_kernel.cpp) loops over the rows: it reads
the int8 weights once per row, so in bf16 it beats the model-dtype GEMM ~2.3x at one row and loses
from ~6 rows on, and its fp32 path is slower than the fp32 GEMM even at one row
(benchmarks/quant_linear.py measures both on this machine). A bf16 / fp16 call of at most
`PACKED_MAX_ROWS` rows (decode of a few sequences) runs that kernel; any other (prefill, wider
decode, fp32) converts the weights to the model dtype `CHUNK_ROWS` output channels at a time and runs
the GEMM with the scales applied to its output: the same products, rounded once more. That route
costs the conversion on top of the GEMM (~2x the bf16 GEMM at 8–64 rows, ~1.7x at 300 on this
CPU): int8 buys memory everywhere and speed only at light decode load.

`Int8DynamicLinear` (W8A8) holds the same weights and quantizes each call's activations per token
(row) the same symmetric way: sx = max|x| / 127, xq = round(x / sx); torch's `_int_mm` sums xq · q
exactly in int32 (aten/src/ATen/native/cpu: an int8 GEMM with VNNI / AMX where the CPU has them)
and the output is acc · sx · scale in fp32, rounded to the model dtype. It is fast at every row
count here (~1.7x the bf16 GEMM at 1–32 rows on this CPU, benchmarks/quant_linear.py), at the price
of the activations' rounding: its outputs differ from the unquantized model's more than W8A16's.
"""
from __future__ import annotations

import torch

from epdserve.engine.lm.fusion import fuse

PACKED_MAX_ROWS = 4  # bf16/fp16 rows up to which `_weight_int8pack_mm` beats the GEMM (this CPU)
CHUNK_ROWS = 2048  # output channels converted to the model dtype at once on the GEMM route


def quantize_int8(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(q int8 [out, in], scales [out] in `w`'s dtype) of `w` [out, in], per output channel,
    symmetric. The scale is rounded to the dtype first and q computed against the rounded one, so
    dequantizing is within half a step of w (a step past 127 is clamped)."""
    wf = w.float()
    scales = (wf.abs().amax(dim=1) / 127.0).clamp(min=torch.finfo(w.dtype).tiny).to(w.dtype)
    q = torch.round(wf / scales.float()[:, None]).clamp_(-127, 127).to(torch.int8)
    return q.contiguous(), scales


def dequantize_int8(q: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The weights `q` and `scales` stand for, in `dtype` (what `Int8Linear` computes with)."""
    return (q.float() * scales.float()[:, None]).to(dtype)


class Int8Linear:
    """Int8 weights per output channel (W8A16); bias, if any, in the model dtype."""

    def __init__(self, weights: list[torch.Tensor], biases: list[torch.Tensor | None] | None = None):
        w, self.bias = fuse(weights, biases)
        self.packed_rows = 0 if w.dtype == torch.float32 else PACKED_MAX_ROWS  # its fp32 path is slow
        self.q, self.scales = quantize_int8(w)
        self.out_features, self.in_features = int(w.shape[0]), int(w.shape[1])

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if x.shape[0] <= self.packed_rows:
            out = torch._weight_int8pack_mm(x, self.q, self.scales)
        else:
            out = torch.empty(x.shape[0], self.out_features, dtype=x.dtype, device=x.device)
            chunk = torch.empty(min(CHUNK_ROWS, self.out_features), self.in_features, dtype=x.dtype, device=x.device)
            for start in range(0, self.out_features, CHUNK_ROWS):
                stop = min(start + CHUNK_ROWS, self.out_features)
                w = chunk[:stop - start]
                w.copy_(self.q[start:stop])
                out[:, start:stop] = torch.mm(x, w.t())
            out.mul_(self.scales)
        return out if self.bias is None else out.add_(self.bias)

    def tensors(self) -> list[torch.Tensor]:
        return [self.q, self.scales] if self.bias is None else [self.q, self.scales, self.bias]


def quantize_rows(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(xq int8, sx fp32 [rows, 1]) of activations `x` [rows, in], per row, symmetric."""
    xf = x.float()
    sx = xf.abs().amax(dim=1, keepdim=True).div_(127.0).clamp_(min=torch.finfo(torch.float32).tiny)
    return torch.round(xf / sx).clamp_(-127, 127).to(torch.int8), sx


class Int8DynamicLinear:
    """Int8 weights per output channel, activations quantized per token at run time (W8A8)."""

    def __init__(self, weights: list[torch.Tensor], biases: list[torch.Tensor | None] | None = None):
        w, self.bias = fuse(weights, biases)
        self.q, scales = quantize_int8(w)
        self.qt = self.q.t()  # [in, out] view: `_int_mm`'s second operand
        self.scales = scales.float()
        self.out_features = int(w.shape[0])

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        xq, sx = quantize_rows(x)
        out = torch._int_mm(xq, self.qt).float().mul_(sx).mul_(self.scales).to(x.dtype)
        return out if self.bias is None else out.add_(self.bias)

    def tensors(self) -> list[torch.Tensor]:
        return [self.q, self.scales] if self.bias is None else [self.q, self.scales, self.bias]
