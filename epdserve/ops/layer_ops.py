"""`LayerOps`: the fused element-wise operators of one LM layer, behind one interface per platform.

The lean LM forward (engine/lm/) calls only these between its matmuls and the paged attention:
- `add_rms_norm(x, residual, weight, eps) -> (normed, summed)`: `summed = residual + x` (in x's
  dtype, rounded as transformers rounds `residual + hidden_states`), `normed` = transformers'
  Qwen2RMSNorm of `summed` (variance in fp32, `weight * normed.to(dtype)`); `residual=None`
  means "no residual yet" (`summed = x`). Implementations may write into `x` / `residual`
  (callers pass tensors they own and use only the returned ones);
- `rms_norm(x, weight, eps) -> normed` (the same, no residual; Qwen3's q/k norms per head:
  x [..., head_dim]);
- `rotary(q, k, cos, sin) -> (q, k)`: q [T, H, d], k [T, KVH, d] (the token dim may be strided,
  the last two dims contiguous), cos/sin [T, d] in the rotate-half convention (both halves of a
  row repeat the frequencies, as transformers' rotary embeddings return them); `q * cos +
  rotate_half(q) * sin` (the same for k), computed in q's dtype as transformers does. May rotate
  in place;
- `silu_and_mul(x) -> y`: x [T, 2I] (gate then up, the fused gate_up projection's output),
  `y = silu(x[:, :I]) * x[:, I:]` [T, I], each op rounded to x's dtype as transformers' MLP does.

At start-up an engine tells the operators the model's range of rotary values (`rotary_range`)
and its layer shapes (`check(LayerShapes, device)`: implementations that compile kernels run
them once there and refuse to start, with the fix, when they fail; engine/model_runner.py).

`PortableLayerOps` is plain torch (any device; the reference the others are tested against); the
native csrc/ operators (CPU) and torch_npu's kernels (Ascend) implement the same contract.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F


@dataclass(frozen=True)
class LayerShapes:
    """One LM layer's sizes, as its operators see them (this rank's heads under tensor parallelism)."""

    hidden: int
    heads: int
    kv_heads: int
    head_dim: int
    intermediate: int  # the MLP's (gate_up's half); a layer-less or sparse model: any positive size
    dtype: torch.dtype


class LayerOps:
    name: str

    def rotary_range(self, max_abs: float) -> None:
        """Told once, before any call (engine/model_runner.py): the largest |cos| and |sin| the
        model's rotary tables hold (1, or the rope's attention scaling). Default: anything goes."""

    def check(self, shapes: LayerShapes, device: torch.device) -> None:
        """Raise, with the fix, when these operators cannot run layers of `shapes` on `device`.
        Called once at engine start-up (engine/model_runner.py). Default: anything goes."""

    def add_rms_norm(self, x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor,
                     eps: float) -> tuple[torch.Tensor, torch.Tensor]:
        raise NotImplementedError

    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        raise NotImplementedError

    def rotary(self, q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor,
               sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        raise NotImplementedError

    def silu_and_mul(self, x: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError


class PortableLayerOps(LayerOps):
    """Plain torch, the same arithmetic as transformers' Qwen2 / Qwen3 modules (stateless)."""

    name = "portable"

    def add_rms_norm(self, x, residual, weight, eps):
        summed = x if residual is None else residual + x
        return self.rms_norm(summed, weight, eps), summed

    def rms_norm(self, x, weight, eps):
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
        return weight * h.to(x.dtype)

    def rotary(self, q, k, cos, sin):
        c, s = cos[:, None, :], sin[:, None, :]
        return q * c + _rotate_half(q) * s, k * c + _rotate_half(k) * s

    def silu_and_mul(self, x):
        gate, up = x.chunk(2, dim=-1)
        return F.silu(gate) * up


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    h = x.shape[-1] // 2
    return torch.cat((-x[..., h:], x[..., :h]), dim=-1)
