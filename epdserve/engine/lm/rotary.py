"""`RotaryTable`: the M-RoPE cos/sin of a packed batch, gathered from per-position tables.

transformers computes, per token and per rotary frequency j, `cos(pos[axis(j)] * inv_freq[j])`
in fp32, where `axis(j)` says which of the three M-RoPE position streams (temporal, height,
width) frequency j follows: contiguous sections for Qwen2-VL / Qwen2.5-VL, interleaved for
Qwen3-VL (each family's `recomposition_frequencies`). The table holds `cos(p * inv_freq[j])` and
`sin(...)` for every position p below its length, computed the same way (one fp32 product, then
cos / sin, times the rope's attention scaling), both halves repeated (rotate-half convention),
cast to the model's dtype. A step then gathers `[T, d]` rows with one flat `index_select` per
table from `pos[axis(j)] * d + j`, so the values equal transformers' bit for bit.

The axis map is read from the model's own rotary module (`recomposition_frequencies` applied to
a frequency tensor whose value is its stream's number), so a family that lays out its sections
another way is followed without code here.
"""
from __future__ import annotations

import torch


class RotaryTable:
    def __init__(self, rotary_module: torch.nn.Module, head_dim: int, length: int, dtype: torch.dtype,
                 device: torch.device):
        self.head_dim = head_dim
        self.dtype = dtype
        self.device = device
        self.inv_freq = rotary_module.inv_freq.detach().float().cpu()
        self.scaling = float(getattr(rotary_module, "attention_scaling", 1.0))
        half = self.inv_freq.numel()
        if 2 * half != head_dim:
            raise ValueError(f"rotary frequencies {half} do not match head_dim {head_dim}")
        streams = torch.arange(3, dtype=torch.float32).view(3, 1, 1, 1).expand(3, 1, 1, half).clone()
        axis = rotary_module.recomposition_frequencies(streams).reshape(-1)  # [d], values 0..2
        # flat offset of each column's position stream in the [3, T] positions, per column j
        self.axis = axis.round().long().to(device)
        self.cols = torch.arange(head_dim, device=device)
        self.length = 0
        self.cos = self.sin = None
        self.ensure(length)

    def ensure(self, length: int) -> bool:
        """Grow the tables to hold positions below `length` (host-side check by the caller);
        True when they were replaced (graphs that read the old ones must be captured again)."""
        if length <= self.length:
            return False
        n = max(length, 2 * self.length)
        freqs = torch.arange(n, dtype=torch.float32)[:, None] * self.inv_freq[None, :]
        cos, sin = freqs.cos() * self.scaling, freqs.sin() * self.scaling
        self.cos = torch.cat((cos, cos), dim=-1).to(self.device, self.dtype).reshape(-1)
        self.sin = torch.cat((sin, sin), dim=-1).to(self.device, self.dtype).reshape(-1)
        self.length = n
        return True

    def gather(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """positions [3, T] (int64, on the device) → (cos, sin) [T, d] in the model's dtype."""
        idx = positions.index_select(0, self.axis).t() * self.head_dim + self.cols  # [T, d]
        flat = idx.reshape(-1)
        shape = idx.shape
        return self.cos.index_select(0, flat).view(shape), self.sin.index_select(0, flat).view(shape)
