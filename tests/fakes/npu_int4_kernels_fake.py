"""The int4 side of the fake torch_npu's weight-quantized matmul (engine/lm/npu_int4_linear.py): the
packing npu_convert_weight_to_int4pack does, its inverse (how npu_weight_quant_batchmatmul reads an
int32 weight), and the per-group antiquant. Tests only. Sources (op-plugin, branches 7.2.0, 7.3.0,
26.1.0 and master 517f2e7):
- op_plugin/ops/opapi/ConvertWeightToINT4PackKernelNpuOpApi.cpp `int4pack_params_check`: weight
  contiguous, 2-D (26.1.0 also 3-D, and float32 for fp4 on Ascend950: not modelled), int32, every dim
  > 0, the last a multiple of 8; `convert_to_int4_pack`: the flat data in eights, element 8i + j's low
  four bits (`& 0xF`, no range check: a value outside [-8, 7] wraps) at bits 4j..4j+3 of int32 i;
  output (k, n / 8) int32, ND. docs/zh/custom_APIs/torch_npu/torch_npu-npu_convert_weight_to_int4pack.md:
  values must lie in [-8, 7] (signed int4);
- torch_npu-npu_weight_quant_batchmatmul.md: an int32 weight carries int4 (A2 / A3) as (K, N / 8);
  pergroup antiquant_scale (ceil(K / antiquant_group_size), N), antiquant_offset of its shape and
  dtype; antiquant_group_size in [32, K - 1], a multiple of 32 (0: perchannel / pertensor);
  ANTIQUANT(weight) = (weight + antiquant_offset) · antiquant_scale, the group's row of scale and
  offset for each of its K rows.
"""
from __future__ import annotations

import torch

PER_INT32 = 8


def _require(cond, msg):
    if not cond:
        raise RuntimeError(msg)  # what a failed TORCH_CHECK / aclnn parameter check surfaces as


def pack_int4(v: torch.Tensor) -> torch.Tensor:
    """`convert_to_int4_pack` over a 2-D int32 tensor: (k, n) -> (k, n / 8) int32."""
    k, n = v.shape
    nib = (v.to(torch.int64) & 0xF).reshape(k, n // PER_INT32, PER_INT32)
    word = (nib << (4 * torch.arange(PER_INT32))).sum(-1)  # disjoint bits: the sum is the OR
    return torch.where(word >= 2 ** 31, word - 2 ** 32, word).to(torch.int32)


def unpack_int4(w: torch.Tensor) -> torch.Tensor:
    """The signed int4 values an int32-packed (K, N / 8) weight carries: (K, N) int32 in [-8, 7]."""
    nib = (w.to(torch.int64).unsqueeze(-1) >> (4 * torch.arange(PER_INT32))) & 0xF
    return torch.where(nib >= 8, nib - 16, nib).reshape(w.shape[0], -1).to(torch.int32)


def convert_weight_to_int4pack(a: dict) -> torch.Tensor:
    w = a["weight"]
    _require(w.is_contiguous(), "weight should be contiguous")
    _require(w.dim() == 2, f"weight shape only support dim num 2, but it is {w.dim()}")
    _require(w.dtype == torch.int32, f"weight dtype only support int32, but it is {w.dtype}")
    _require(w.shape[0] > 0 and w.shape[1] > 0, "weight dim should be greater than 0")
    _require(w.shape[1] % PER_INT32 == 0, f"weight last dim should be the multiple of 8, but it is {w.shape[1]}")
    return pack_int4(w)


def grouped(t: torch.Tensor, group: int, k: int) -> torch.Tensor:
    """A pergroup (K / group, N) scale or offset as the (K, N) one each weight row uses (fp32)."""
    return t.float().repeat_interleave(group, dim=0)[:k]


def check_group(scale: torch.Tensor, offset, group: int, k: int, n: int) -> None:
    _require(group % 32 == 0 and 32 <= group <= k - 1,
             f"antiquant_group_size: a multiple of 32 in [32, K - 1] = [32, {k - 1}], got {group}")
    _require(tuple(scale.shape) == (-(-k // group), n), f"pergroup antiquant_scale: (ceil(K / {group}), N)")
    _require(offset is None or (offset.dtype == scale.dtype and offset.shape == scale.shape),
             "antiquant_offset: antiquant_scale's shape and dtype")
