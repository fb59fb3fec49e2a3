"""How a projection's fused parts (QKV's three, gate-up's two, or one) become one weight and one
bias, for every method of the linear-layer contract (engine/lm/linear.py, quant_linear.py)."""
from __future__ import annotations

import torch


def fuse(weights: list[torch.Tensor], biases: list[torch.Tensor | None] | None = None
         ) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(the parts' [out_i, in] weights concatenated on out, their biases likewise: a part without
    one adds zeros; None when no part has one)."""
    w = weights[0] if len(weights) == 1 else torch.cat(weights)
    return w, fuse_bias(biases, [p.shape[0] for p in weights], w.dtype, w.device)


def fuse_bias(biases: list[torch.Tensor | None] | None, outs: list[int], dtype: torch.dtype,
              device) -> torch.Tensor | None:
    """The parts' biases concatenated (a part of `outs[i]` outputs without one adds zeros), or None
    when no part has one."""
    if biases is None or all(b is None for b in biases):
        return None
    return torch.cat([b if b is not None else torch.zeros(n, dtype=dtype, device=device)
                      for b, n in zip(biases, outs)])
