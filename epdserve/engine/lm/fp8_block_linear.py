"""Block-wise FP8 projections (Qwen's and DeepSeek's own FP8 checkpoints, `"quant_method": "fp8"`
with `weight_block_size` [bn, bk]; engine/lm/fp8_checkpoint.py reads the description): the
linear-layer contract's `Fp8BlockLinear`.

The format (transformers integrations/finegrained_fp8.py: `FP8Linear.__init__` holds `weight`
float8_e4m3fn [out, in] and `weight_scale_inv` fp32 [ceil(out / bn), ceil(in / bk)];
`_dequantize_fp8_weight`: the weights stand for weight · weight_scale_inv of their block — the
name notwithstanding, a multiplier; vLLM fp8.py `Fp8LinearMethod` with `W8A8BlockFp8LinearOp`):
activations quantized at run time per token and per group of bk inputs (`activation_scheme`
"dynamic"; scale max|x| / 448 of the group, as transformers' `act_quant` and vLLM's
`per_token_group_quant_fp8`).

Applied as one `torch._scaled_mm` per group of bk inputs with rowwise scales — the group's
activation scales [tokens, 1] and its weight scales repeated over each block's rows [1, out] —
their fp32 products summed in fp32. Correct on any device that runs rowwise `_scaled_mm`
(engine/lm/fp8_device.py), not fast: a native block-scaled GEMM (torch's 1x128 × 128x128
"DeepSeek recipe", Hopper with cuBLAS ≥ 12.9 only) is not wired. Under tensor parallelism a
rank's share of a row-parallel projection (o, down) must be whole groups of bk inputs, as vLLM
requires (`validate_fp8_block_shape`): engine/lm/fp8_parts.py refuses otherwise.
"""
from __future__ import annotations

import torch

from epdserve.engine.lm.fp8_linear import dynamic_scale, quantize_fp8
from epdserve.engine.lm.fusion import fuse_bias


def block_row_scales(scale_inv: torch.Tensor, rows: range, block_n: int) -> torch.Tensor:
    """[len(rows), in groups] fp32: each of `rows`' weight scales (its block row of `scale_inv`)."""
    idx = torch.arange(rows.start, rows.stop, device=scale_inv.device) // block_n
    return scale_inv.float()[idx]


def dequantize_fp8_blocks(q: torch.Tensor, row_scales: torch.Tensor, block_k: int, dtype: torch.dtype) -> torch.Tensor:
    """The weights q [out, in] stand for, given each row's group scales [out, ceil(in / block_k)]."""
    return (q.float() * row_scales.repeat_interleave(block_k, dim=1)[:, : q.shape[1]]).to(dtype)


class Fp8BlockLinear:
    """Block-wise FP8 weights, per-token-group FP8 activations (see the module docstring)."""

    def __init__(self, qs: list[torch.Tensor], row_scales: list[torch.Tensor], biases: list[torch.Tensor | None],
                 dtype: torch.dtype, block_k: int):
        """Each part's q [out_i, in] float8_e4m3fn and its rows' group scales [out_i, ceil(in / block_k)]."""
        q = torch.cat(qs) if len(qs) > 1 else qs[0]
        scales = torch.cat(row_scales).float()
        self.block_k = block_k
        self.out_features, in_features = int(q.shape[0]), int(q.shape[1])
        self.bounds = [(k, min(k + block_k, in_features)) for k in range(0, in_features, block_k)]
        if scales.shape != (self.out_features, len(self.bounds)):
            raise ValueError(f"block-wise FP8: {tuple(scales.shape)} row scales for a [{self.out_features}, "
                             f"{in_features}] weight in groups of {block_k} inputs")
        self.groups = [q[:, a:b].contiguous() for a, b in self.bounds]  # each group's [out, in_g], row-major
        self.scale_bs = [scales[:, g].reshape(1, -1).contiguous() for g in range(len(self.bounds))]
        self.bias = fuse_bias(biases, [p.shape[0] for p in qs], dtype, q.device)

    @property
    def q(self) -> torch.Tensor:
        """The whole weight [out, in] (a copy: the groups are what is held)."""
        return torch.cat(self.groups, dim=1)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        acc = None
        for (a, b), g, sb in zip(self.bounds, self.groups, self.scale_bs):
            qt = g.t()  # [in_g, out], column-major: `_scaled_mm`'s second operand
            xg = x[:, a:b]
            sx = dynamic_scale(xg, per_token=True)
            part = torch._scaled_mm(quantize_fp8(xg, sx), qt, scale_a=sx, scale_b=sb, out_dtype=torch.float32)
            acc = part if acc is None else acc.add_(part)
        out = acc.to(x.dtype)
        return out if self.bias is None else out.add_(self.bias)

    def tensors(self) -> list[torch.Tensor]:
        return [*self.groups, *self.scale_bs] + ([self.bias] if self.bias is not None else [])
