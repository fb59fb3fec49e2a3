"""A checkpoint's FP8 projections read into the linear-layer contract (engine/lm/fp8_linear.py
`Fp8Linear.prequantized`, engine/lm/fp8_block_linear.py `Fp8BlockLinear`): `read_fp8` takes a
projection's parts (each (module, rows, cols): the rank's slice; None for the whole) under a
decoder layer's prefix, as engine/lm/shard_loader.py hands them for attention and the dense MLP,
and engine/lm/per_expert.py for each MoE expert's whole tensors.
"""
from __future__ import annotations

import torch

from epdserve.engine.lm.fp8_block_linear import Fp8BlockLinear, block_row_scales
from epdserve.engine.lm.fp8_checkpoint import Fp8Scheme
from epdserve.engine.lm.fp8_linear import FP8, Fp8Linear


def read_fp8(reader, p: str, parts, biases, dtype, device, scheme: Fp8Scheme) -> Fp8Linear:
    """A compressed-tensors FP8 checkpoint's parts (engine/lm/fp8_checkpoint.py): the rank's slice of
    each float8_e4m3fn weight; its `weight_scale`, one value (per tensor, the same on every rank) or
    [out, 1] / [out] (per channel: the rank's rows, all of them for a projection split by its
    inputs); static activations' `input_scale` (one value). A scale of another shape, not finite or
    not > 0, is refused naming the tensor."""
    if scheme.weights == "block":
        return read_fp8_block(reader, p, parts, biases, dtype, device, scheme)
    qs, scales, input_scales = [], [], []
    for m, rows, cols in parts:
        name = p + m
        q = reader.get(name + ".weight", rows, cols)
        if q.dtype != FP8:
            raise ValueError(f"{name}.weight is {q.dtype}, expected float8_e4m3fn")
        out = reader.shape(name + ".weight")[0]
        if name + ".weight_scale" not in reader:
            raise ValueError(f"{name}: FP8 weight without its weight_scale")
        shape = reader.shape(name + ".weight_scale")
        want = ([out, 1], [out]) if scheme.weights == "channel" else ([], [1], [1, 1])
        if shape not in want:
            raise ValueError(f"{name}.weight_scale has shape {shape}; a per-{scheme.weights} FP8 weight of {out} "
                             f"output rows needs {' or '.join(map(str, want))}")
        s = reader.get(name + ".weight_scale", rows if scheme.weights == "channel" else None).float().reshape(-1)
        check_scales(name + ".weight_scale", s)
        if scheme.activations == "static":
            if name + ".input_scale" not in reader or reader.get(name + ".input_scale").numel() != 1:
                raise ValueError(f"{name}: static FP8 activations need one input_scale value")
            x_scale = reader.get(name + ".input_scale").float().reshape(-1)
            check_scales(name + ".input_scale", x_scale)
            input_scales.append(float(x_scale[0]))
        qs.append(q.to(device).contiguous())
        scales.append(s.to(device))
    return Fp8Linear.prequantized(qs, scales, biases, dtype, scheme.activations, input_scales or None)


def read_fp8_block(reader, p: str, parts, biases, dtype, device, scheme: Fp8Scheme) -> Fp8BlockLinear:
    """Block-wise FP8 parts (engine/lm/fp8_block_linear.py): the rank's slice of each float8_e4m3fn
    weight and, per row of it, the `weight_scale_inv` of its block row over the rank's groups of
    inputs — which must be whole groups of block[1] (refused otherwise, naming the width)."""
    bn, bk = scheme.block
    qs, row_scales = [], []
    for m, rows, cols in parts:
        name = p + m
        q = reader.get(name + ".weight", rows, cols)
        if q.dtype != FP8:
            raise ValueError(f"{name}.weight is {q.dtype}, expected float8_e4m3fn")
        out, inputs = reader.shape(name + ".weight")
        if name + ".weight_scale_inv" not in reader:
            raise ValueError(f"{name}: block-wise FP8 weight without its weight_scale_inv")
        want = [-(-out // bn), -(-inputs // bk)]
        if reader.shape(name + ".weight_scale_inv") != want:
            raise ValueError(f"{name}.weight_scale_inv has shape {reader.shape(name + '.weight_scale_inv')}; a "
                             f"[{out}, {inputs}] weight in blocks of {[bn, bk]} needs {want}")
        cols = cols or range(inputs)
        if cols.start % bk or (cols.stop % bk and cols.stop != inputs):
            raise ValueError(f"{name}: this rank's inputs {cols.start}..{cols.stop} are not whole groups of {bk} "
                             f"(weight_block_size): choose a tensor_parallel_size whose share of {inputs} is")
        s = reader.get(name + ".weight_scale_inv").float()
        check_scales(name + ".weight_scale_inv", s)
        s = s[:, cols.start // bk: -(-cols.stop // bk)]
        qs.append(q.to(device).contiguous())
        row_scales.append(block_row_scales(s, rows or range(out), bn).to(device))
    return Fp8BlockLinear(qs, row_scales, biases, dtype, bk)


def check_scales(name: str, s: torch.Tensor) -> None:
    """ValueError unless every scale in `s` is finite and > 0."""
    if not bool((torch.isfinite(s) & (s > 0)).all()):
        raise ValueError(f"{name} holds a scale that is not finite and > 0")
