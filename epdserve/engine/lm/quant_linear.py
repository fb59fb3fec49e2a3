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
`_weight_int8pack_mm` (aten/src/ATen/native/cpu/int8mm_kernel.cpp) loops over the rows: as measured
here it reads the int8 weights once per block of 4 rows, so in bf16 it beats the model-dtype GEMM ~2.4x at one
row and ~1.5x at 4, then costs one more weight read per 4 rows; its fp32 path is slower than the
fp32 GEMM even at one row (benchmarks/quant_decode.py `kernels` measures them on this machine). A
bf16 / fp16 call of at most `PACKED_MAX_ROWS` rows runs that kernel; any other (prefill, wider
decode, fp32) converts the weights to the model dtype `CHUNK_ROWS` output channels at a time and
runs the GEMM with the scales applied to its output: the same products, rounded once more. Both
cost more than the bf16 GEMM past 4 rows (on Qwen2-VL-2B's gate-up shape here: ~0.8x at 6–8 rows,
~0.45x at 32, ~0.57x at 256): int8 buys memory everywhere and speed only at light decode load.

`Int8DynamicLinear` (W8A8) holds the same weights and quantizes each call's activations per token
(row) the same symmetric way: sx = max|x| / 127, xq = round(x / sx); torch's `_int_mm` (CPU:
`_int_mm_out_cpu`, aten/src/ATen/native/LinearAlgebra.cpp) sums xq · q exactly in int32, and the output is acc · sx · scale in fp32, rounded to the model dtype. It is fast at every row
count up to ~64 here (1.4–1.6x the bf16 GEMM on the gate-up shape; 0.78x at 256, prefill), at the
price of the activations' rounding: its outputs stray from the unquantized model's more than W8A16's.
"""
from __future__ import annotations

import torch

from epdserve.engine.lm.fusion import fuse, fuse_bias

PACKED_MAX_ROWS = 12  # bf16/fp16 rows up to which `_weight_int8pack_mm` beats converting the weights (this CPU)
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

    @classmethod
    def prequantized(cls, qs: list[torch.Tensor], scales: list[torch.Tensor], biases: list[torch.Tensor | None],
                     dtype: torch.dtype) -> Int8Linear:
        """The projection fusing parts a checkpoint holds quantized already (msModelSlim W8A16,
        engine/lm/prequantized.py): each part's int8 [out_i, in] weights and [out_i] scales."""
        self = cls.__new__(cls)
        self.bias = fuse_bias(biases, [q.shape[0] for q in qs], dtype, qs[0].device)
        self.packed_rows = 0 if dtype == torch.float32 else PACKED_MAX_ROWS
        self.q = (torch.cat(qs) if len(qs) > 1 else qs[0]).contiguous()
        self.scales = torch.cat([s.reshape(-1) for s in scales]).to(dtype)
        self.out_features, self.in_features = int(self.q.shape[0]), int(self.q.shape[1])
        return self

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
        q, scales = quantize_int8(w)
        self._hold(q, scales)

    def _hold(self, q: torch.Tensor, scales: torch.Tensor) -> None:
        self.q = q.contiguous()
        self.qt = self.q.t()  # [in, out] view: `_int_mm`'s second operand
        self.scales = scales.float()
        self.out_features = int(q.shape[0])

    @classmethod
    def prequantized(cls, qs: list[torch.Tensor], scales: list[torch.Tensor], biases: list[torch.Tensor | None],
                     dtype: torch.dtype) -> Int8DynamicLinear:
        """The projection fusing parts a checkpoint holds quantized already (engine/lm/prequantized.py):
        each part's int8 [out_i, in] weights and its [out_i] scales; `biases` in `dtype`."""
        self = cls.__new__(cls)
        self.bias = fuse_bias(biases, [q.shape[0] for q in qs], dtype, qs[0].device)
        self._hold(torch.cat(qs) if len(qs) > 1 else qs[0], torch.cat([s.reshape(-1) for s in scales]))
        return self

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        xq, sx = quantize_rows(x)
        out = torch._int_mm(xq, self.qt).float().mul_(sx).mul_(self.scales).to(x.dtype)
        return out if self.bias is None else out.add_(self.bias)

    def tensors(self) -> list[torch.Tensor]:
        return [self.q, self.scales] if self.bias is None else [self.q, self.scales, self.bias]
