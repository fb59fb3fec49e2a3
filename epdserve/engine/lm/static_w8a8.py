"""msModelSlim's static W8A8 projection (description type "W8A8"): int8 weights per output channel,
the activations quantized per tensor with a scale and offset calibrated offline.

The format (MindStudio-ModelSlim `docs/zh/feature_guide/traditional_quantization_v0/
quantized_weight_format.md`, "W8A8, W8A8S量化"): each projection holds `weight` int8 [n, k],
`input_scale` and `input_offset` ([1], the model's float dtype), `deq_scale` [n] (float32 in a bf16
export; int64 in an fp16 one) and `quant_bias` int32 [n], and computes

    input_quant    = input / input_scale + input_offset        (int8)
    output_quant   = input_quant @ weight^T + quant_bias         (int32)
    output         = output_quant * deq_scale

so `quant_bias` carries both the layer's float bias and the offset's share (-input_offset * the
row sums of `weight`). vllm-ascend runs exactly that (`quantization/methods/w8a8_static.py`,
`AscendW8A8LinearMethod.apply`: `npu_quantize` with the scale's reciprocal and the offset, then
`npu_quant_matmul(x, weight, deq_scale, bias=quant_bias)`; the layer's float `bias` argument is not
used), and adds `quant_bias` on tensor-parallel rank 0 only for a projection split by its inputs
(`method_adapters.py` `AscendLinearMethod.apply`: tp_rank for a RowParallelLinear, 0 otherwise):
the ranks' partial sums are added, so the bias must be counted once. The same here: a part built
with `quant_bias=None` adds none.

On CPU: the activations are quantized in fp32 as vllm-ascend does (times the scale's reciprocal,
plus the offset, rounded half to even, clamped to [-128, 127]), `torch._int_mm` sums the int8
products exactly in int32, then quant_bias is added and deq_scale applied in fp32, rounded to the
model dtype once. Fused parts (QKV's three, gate-up's two) whose input scale and offset agree run
as one GEMM; parts calibrated differently quantize the input once per distinct (scale, offset).
An fp16 export's int64 `deq_scale` is refused at load (its encoding for the NPU op is not read here).
On an NPU the same parts run on torch_npu's kernels: engine/lm/npu_static_w8a8.py.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

QMIN, QMAX = -128, 127


def quantize_per_tensor(x: torch.Tensor, scale: float, offset: int) -> torch.Tensor:
    """int8 activations of `x` [rows, in]: round(x * (1 / scale) + offset), clamped (fp32)."""
    recip = torch.tensor(1.0, dtype=torch.float32) / torch.tensor(scale, dtype=torch.float32)
    return torch.round(x.float() * recip + offset).clamp_(QMIN, QMAX).to(torch.int8)


@dataclass
class StaticPart:
    """One projection's share of a fused one: its int8 weights [out_i, in] and parameters."""

    q: torch.Tensor
    input_scale: float
    input_offset: int
    deq_scale: torch.Tensor  # fp32 [out_i]
    quant_bias: torch.Tensor | None  # int32 [out_i]; None: this rank adds none (split by inputs, rank > 0)


def runs(parts: list[StaticPart]) -> list[list[StaticPart]]:
    """`parts` cut into runs of consecutive parts sharing one (input scale, offset): one GEMM each."""
    out: list[list[StaticPart]] = []
    for p in parts:
        if out and (p.input_scale, p.input_offset) == (out[-1][0].input_scale, out[-1][0].input_offset):
            out[-1].append(p)
        else:
            out.append([p])
    return out


def quant_bias(parts: list[StaticPart]) -> torch.Tensor | None:
    """The parts' quant_bias, int32, concatenated (zeros for a part without; None: no part has one)."""
    biases = [p.quant_bias for p in parts]
    if all(b is None for b in biases):
        return None
    return torch.cat([b.reshape(-1).to(torch.int32) if b is not None else torch.zeros(p.q.shape[0], dtype=torch.int32,
                                                                                        device=p.q.device)
                      for b, p in zip(biases, parts)])


class _Group:
    """Consecutive parts sharing one (input scale, offset): one int8 GEMM."""

    def __init__(self, parts: list[StaticPart]):
        self.scale, self.offset = parts[0].input_scale, parts[0].input_offset
        self.q = torch.cat([p.q for p in parts]).contiguous()
        self.qt = self.q.t()  # [in, out]: `_int_mm`'s second operand
        self.deq = torch.cat([p.deq_scale.float().reshape(-1) for p in parts])
        self.bias = quant_bias(parts)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        acc = torch._int_mm(quantize_per_tensor(x, self.scale, self.offset), self.qt)
        if self.bias is not None:
            acc.add_(self.bias)
        return acc.float().mul_(self.deq)


class StaticW8A8Linear:
    """msModelSlim static W8A8 (see the module docstring); the linear-layer contract's `Linear`."""

    def __init__(self, parts: list[StaticPart]):
        self.groups = [_Group(run) for run in runs(parts)]
        self.out_features = sum(int(p.q.shape[0]) for p in parts)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        outs = [g(x) for g in self.groups]
        return (outs[0] if len(outs) == 1 else torch.cat(outs, dim=1)).to(x.dtype)

    def tensors(self) -> list[torch.Tensor]:
        out = []
        for g in self.groups:
            out += [g.q, g.deq] + ([g.bias] if g.bias is not None else [])
        return out
