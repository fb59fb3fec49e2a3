"""The linear-layer contract: how one projection of the LM holds its weights and is applied —
the one place a tensor-parallel shard, and later a quantized or prepacked weight, plugs in.

A projection is a `Linear`: `linear(x)` maps [tokens, in] to [tokens, out] and `tensors()` lists
what it holds (the forward's graph capture and parameter count read them). It is built from the
checkpoint's own tensors by its `method` (`LINEAR_METHODS`), given the parts it fuses (QKV's
three, gate-up's two, or one) already cut to the rank's slice (engine/lm/shard_loader.py, or
transformers' modules at tensor_parallel_size 1): a method sees whole [out, in] weights of its
rank and decides how to hold them. `DenseLinear` is the only method today: the weights in the
model dtype, fused and stored transposed ([in, out] views of row-major [out, in] tensors) so a
call is one `mm` / `addmm` with no per-call transpose. A quantized method (int8 / int4 weights
with their scales, W8A8) would read its scales by the same slices and apply its own kernel.
"""
from __future__ import annotations

from typing import Protocol

import torch


class Linear(Protocol):
    out_features: int

    def __call__(self, x: torch.Tensor) -> torch.Tensor: ...

    def tensors(self) -> list[torch.Tensor]: ...


class DenseLinear:
    """Weights in the model dtype, [in, out] (transposed views), bias or None."""

    def __init__(self, weights: list[torch.Tensor], biases: list[torch.Tensor | None] | None = None):
        """`weights`: the fused parts' [out_i, in] tensors, concatenated on out; `biases`: theirs
        (a part without one adds zeros; all None: no bias)."""
        w = weights[0] if len(weights) == 1 else torch.cat(weights)
        self.t = w.t()
        self.out_features = int(w.shape[0])
        self.bias = None
        if biases is not None and any(b is not None for b in biases):
            self.bias = torch.cat([b if b is not None else torch.zeros(p.shape[0], dtype=p.dtype, device=p.device)
                                   for b, p in zip(biases, weights)])

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return torch.mm(x, self.t) if self.bias is None else torch.addmm(self.bias, x, self.t)

    def tensors(self) -> list[torch.Tensor]:
        return [self.t] if self.bias is None else [self.t, self.bias]


LINEAR_METHODS = {"dense": DenseLinear}  # quantization name -> its Linear (engine/lm/linear.py)


def make_linear(weights: list[torch.Tensor], biases: list[torch.Tensor | None] | None = None,
                method: str = "dense") -> Linear:
    """The projection fusing `weights` (each [out_i, in], the rank's slice) by `method`."""
    try:
        cls = LINEAR_METHODS[method]
    except KeyError:
        raise ValueError(f"unknown linear method {method!r}; known: {', '.join(LINEAR_METHODS)}") from None
    return cls(weights, biases)
