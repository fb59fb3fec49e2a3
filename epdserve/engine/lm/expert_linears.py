"""How a MoE layer's experts hold their weights (engine/lm/experts.py `ExpertShard`): one
projection per local expert, by the method the dense linears run (`--quantization`, issue 49).

The checkpoint fuses each layer's experts into [E, out, in] tensors (gate_up [E, 2 I, hidden],
down [E, hidden, I]); `expert_linears` turns a rank's [E_local, out, in] slice into one projection
per expert. "dense": `DenseExpert`, expert e's [out, in] slice applied by `F.linear`, transformers'
own call, so the layer's sum stays transformers' bit for bit. A quantized method: each expert's
slice is a projection of the linear-layer contract (engine/lm/linear.py `make_linear`: `Int8Linear`
W8A16, `Int8DynamicLinear` W8A8, `Int4Linear` W4A16, `Fp8Linear` FP8 with per-token activations),
quantized from that expert's weights alone (per output channel, per group of 128 inputs, or — fp8 —
one scale for the expert's fused gate-up and one for its down) and applied by the same torch
kernels as the dense projections.

Which methods quantize experts: `QUANTIZES_EXPERTS` (int8, w8a8, int4, fp8, quantized at load).
A checkpoint quantized already holds them as its files do, never re-quantized: an FP8 checkpoint's
experts stored one module each are read as FP8 projections (engine/lm/per_expert.py), its fused
[E, ...] float experts and an msModelSlim checkpoint's experts are held dense; `expert_method` says
which method the fused experts take.

Tensor parallelism splits the experts over the ranks whole (engine/tp/shard.py `expert_range`),
never an expert's inputs: int4's groups must divide hidden_size (gate_up's inputs) and
moe_intermediate_size (down's) at every degree. `check_expert_groups` refuses a model whose
expert widths are not whole groups, naming them, before the experts are read.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from epdserve.engine.lm.int4_linear import GROUP_SIZE
from epdserve.engine.lm.linear import Linear, make_linear


QUANTIZES_EXPERTS = ("int8", "w8a8", "int4", "fp8")


def expert_method(method: str, prequantized: bool = False) -> str:
    """The method a MoE layer's experts are held by when the projections run `method`
    (`prequantized`: the checkpoint carries its own quantization)."""
    return method if method in QUANTIZES_EXPERTS and not prequantized else "dense"


class DenseExpert:
    """One expert's [out, in] weights in the model dtype, applied as transformers applies them."""

    def __init__(self, w: torch.Tensor):
        self.w = w
        self.out_features = int(w.shape[0])

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.w)

    def tensors(self) -> list[torch.Tensor]:
        return [self.w]


def check_expert_groups(method: str, widths: dict[str, int]) -> None:
    """ValueError when `method` is int4 and an expert projection's input width (`widths`: name ->
    inputs, e.g. {"down_proj (moe_intermediate_size)": 32}) is not whole groups of `GROUP_SIZE`."""
    if method != "int4":
        return
    bad = [f"{name} takes {k}" for name, k in widths.items() if k % GROUP_SIZE]
    if bad:
        raise ValueError(f"quantization=int4 quantizes inputs in groups of {GROUP_SIZE}, but the MoE experts' "
                         f"{' and '.join(bad)} inputs (experts are split over tensor-parallel ranks whole, so no "
                         f"degree changes that): use int8 or w8a8")


def expert_linears(stacked: torch.Tensor, method: str, name: str, platform: str = "cpu") -> list[Linear]:
    """One projection per expert of `stacked` [E_local, out, in] (the experts' `name`, for a
    refusal), held by `method` on `platform` (engine/lm/linear.py `linear_class`)."""
    if method == "dense":
        return [DenseExpert(w) for w in stacked.unbind(0)]
    check_expert_groups(method, {name: int(stacked.shape[2])})
    return [make_linear([w.contiguous()], None, method, platform) for w in stacked.unbind(0)]
