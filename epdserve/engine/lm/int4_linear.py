"""Int4 weight-only projections of the linear-layer contract (engine/lm/linear.py): W4A16,
`--quantization int4`, group-wise, quantized from the checkpoint's weights at load.

Each output channel's weights are cut into groups of `GROUP_SIZE` (128) consecutive inputs; a group
holds 4-bit codes q in 0..15 with a scale and a zero of its own, asymmetric: scale = (max - min) / 15,
zero = min + 8 · scale, both rounded to the model dtype first, then q = round((w - zero) / scale + 8)
clamped to 0..15, so the weight the kernel computes with is (q - 8) · scale + zero (`dequantize_int4`;
torch's convention for `_weight_int4pack_mm_for_cpu`, checked against the dense product in the
tests). Activations, the KV cache and the output stay in the model dtype. Held as torch's CPU
kernel wants them: the codes packed two to a byte by `_convert_weight_to_int4pack_for_cpu`
([out, in / 2] uint8) and the scales and zeros as one [in / 128, out, 2] tensor in the model dtype.
Fused parts (QKV's three, gate-up's two) are quantized per output channel, so fusing changes nothing.

Under tensor parallelism a row-parallel projection's rank holds a slice of the inputs (o_proj's
heads, down_proj's MLP columns): that slice must be whole groups, refused at load otherwise,
naming the projection's width on the rank and the group.
"""
from __future__ import annotations

import torch

from epdserve.engine.lm.fusion import fuse

GROUP_SIZE = 128  # inputs per group (the W4A16 group; torch's kernel takes 32, 64, 128 or 256)
INNER_K_TILES = 1  # `_convert_weight_to_int4pack_for_cpu`'s tiling argument (the CPU kernel's packing ignores it)


def quantize_int4(w: torch.Tensor, group: int = GROUP_SIZE) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(q int32 [out, in] in 0..15, scales [out, in / group], zeros [out, in / group] in `w`'s dtype)."""
    out_f, in_f = w.shape
    g = w.float().reshape(out_f, in_f // group, group)
    lo, hi = g.amin(-1), g.amax(-1)
    scales = ((hi - lo) / 15.0).clamp(min=torch.finfo(w.dtype).tiny).to(w.dtype)
    zeros = (lo + 8.0 * scales.float()).to(w.dtype)
    q = torch.round((g - zeros.float()[..., None]) / scales.float()[..., None] + 8.0).clamp_(0, 15)
    return q.to(torch.int32).reshape(out_f, in_f), scales, zeros


def dequantize_int4(q: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor, dtype: torch.dtype,
                    group: int = GROUP_SIZE) -> torch.Tensor:
    """The weights `q`, `scales` and `zeros` stand for, in `dtype` (what `Int4Linear` computes with)."""
    out_f, in_f = q.shape
    g = (q.float().reshape(out_f, in_f // group, group) - 8.0) * scales.float()[..., None] + zeros.float()[..., None]
    return g.reshape(out_f, in_f).to(dtype)


class Int4Linear:
    """4-bit weights in groups of `group` inputs (W4A16); bias, if any, in the model dtype. The
    codes are packed for torch's CPU kernel (engine/lm/cuda_int4_linear.py packs them for CUDA's)."""

    group = GROUP_SIZE

    def __init__(self, weights: list[torch.Tensor], biases: list[torch.Tensor | None] | None = None):
        q = self._quantize(weights, biases)
        self.packed = torch._convert_weight_to_int4pack_for_cpu(q, INNER_K_TILES)

    def _quantize(self, weights: list[torch.Tensor], biases: list[torch.Tensor | None] | None) -> torch.Tensor:
        """Fuse the parts, refuse a width that is not whole groups, hold the bias and the scales and
        zeros ([in / group, out, 2]); the codes q [out, in] (0..15) for the subclass to pack."""
        w, self.bias = fuse(weights, biases)
        self.out_features, self.in_features = int(w.shape[0]), int(w.shape[1])
        if self.in_features % self.group:
            raise ValueError(f"quantization=int4 quantizes inputs in groups of {self.group}, but this projection "
                             f"takes {self.in_features} on its rank (a tensor-parallel rank's share of a "
                             f"row-parallel projection must be whole groups): use a lower tensor_parallel_size "
                             f"or int8")
        q, scales, zeros = quantize_int4(w, self.group)
        self.scales_zeros = torch.stack([scales, zeros], dim=-1).transpose(0, 1).contiguous()  # [in/g, out, 2]
        return q

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        out = torch._weight_int4pack_mm_for_cpu(x, self.packed, self.group, self.scales_zeros)
        return out if self.bias is None else out.add_(self.bias)

    def tensors(self) -> list[torch.Tensor]:
        return [self.packed, self.scales_zeros] + ([] if self.bias is None else [self.bias])
