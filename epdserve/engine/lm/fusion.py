"""How a projection's fused parts (QKV's three, gate-up's two, or one) become one weight and one
bias, for every method of the linear-layer contract (engine/lm/linear.py, quant_linear.py)."""
from __future__ import annotations

import torch


def fuse(weights: list[torch.Tensor], biases: list[torch.Tensor | None] | None = None
         ) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(the parts' [out_i, in] weights concatenated on out, their biases likewise: a part without
    one adds zeros; None when no part has one)."""
    w = weights[0] if len(weights) == 1 else torch.cat(weights)
    if biases is None or all(b is None for b in biases):
        return w, None
    return w, torch.cat([b if b is not None else torch.zeros(p.shape[0], dtype=p.dtype, device=p.device)
                         for b, p in zip(biases, weights)])
