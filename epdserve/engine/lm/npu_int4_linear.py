"""The int4 projections of the linear-layer contract (engine/lm/linear.py) on an Ascend NPU: W4A16,
`--quantization int4`, on torch_npu's npu_weight_quant_batchmatmul. The codes, scales and zeros are
the CPU's (engine/lm/int4_linear.py `quantize_int4`: groups of 128 inputs, asymmetric, codes q in
0..15 standing for (q - 8) · scale + zero); only how they are held and applied differs. Not run on
NPU hardware here: tested on the fake torch_npu, which computes what op-plugin documents
(tests/fakes/npu_int4_kernels_fake.py).

Held as vllm-ascend held its W4A16 linear weights (`vllm_ascend/quantization/methods/w4a8.py`
`AscendW4A8DynamicLinearMethod`, at 1a0e6a79, before efda0446db removed it: its
`process_weights_after_loading` transposes the [out, in] codes to [in, out] contiguous and packs them
with `torch_npu.npu_convert_weight_to_int4pack(weight.to(torch.int32))`; its `apply` calls
`npu_weight_quant_batchmatmul(x, weight, antiquant_scale=<[in / group, out] in x's dtype>,
antiquant_group_size=group)`):
- `w`: the signed codes q - 8 (the int4 range [-8, 7] npu_convert_weight_to_int4pack takes:
  op-plugin docs/zh/custom_APIs/torch_npu/torch_npu-npu_convert_weight_to_int4pack.md; vllm-ascend's
  `w4a16.py` `unpack_from_int32` likewise subtracts 2^bits / 2 from the unsigned codes) as [K, N] =
  [in, out] int32, packed along N into [K, N / 8] int32, eight codes per int32, code 8i + j in bits
  4j..4j+3 (op-plugin op_plugin/ops/opapi/ConvertWeightToINT4PackKernelNpuOpApi.cpp
  `convert_to_int4_pack`, the same on branches 7.2.0, 7.3.0 and 26.1.0);
- `scale`: the groups' scales as [K / 128, N] in the model dtype (torch_npu-npu_weight_quant_batchmatmul.md:
  pergroup antiquant_scale (ceil(K / antiquant_group_size), N), of x's dtype);
- `offset`: zero / scale per group, [K / 128, N] in the model dtype (antiquant_offset: antiquant_scale's
  shape and dtype). The document's ANTIQUANT(weight) = (weight + antiquant_offset) · antiquant_scale,
  so (q - 8 + zero / scale) · scale = (q - 8) · scale + zero, the CPU's weight: the offset is the
  (negated) zero point in code units, rounded once to the model dtype (which moves a weight by at most
  half an ulp of zero / scale, times scale: ≤ eps / 2 · |zero|). One exception: a flat group (equal
  weights: Int4Linear clamps its scale to the dtype's tiny, every weight stands for its zero) has a
  zero / scale beyond the dtype's range once |zero| exceeds about 4: it is held as scale zero and
  offset 1 - s0 (s0 its first code), (s0 + 1 - s0) · zero = zero;
- the bias as NpuInt8Linear holds it (fp32 for a bf16 model, fp16 for an fp16 one: the document's rule).
`antiquant_group_size` is 128, except for a projection of exactly one group (K = 128): the document
takes a group size in [32, K - 1] only, and one group is its perchannel mode ((1, N) scale and
offset, group size 0), the same numbers. The document's limits, refused at load naming the width:
K and N in [1, 65535]; N a multiple of 8 (npu_convert_weight_to_int4pack packs the last dim in
eights). A tensor-parallel rank's share of K must be whole groups (Int4Linear's rule, kept). Not
cast to NZ (as engine/lm/npu_quant_linear.py: an NZ weight runs in graph mode only).
"""
from __future__ import annotations

import torch

from epdserve.engine.lm.int4_linear import Int4Linear
from epdserve.engine.lm.npu_quant_linear import check_shape, npu_bias
from epdserve.platform.npu import import_torch_npu

INT4_PER_INT32 = 8  # npu_convert_weight_to_int4pack: eight int4 codes per int32, along the last dim


class NpuInt4Linear(Int4Linear):
    """W4A16 on npu_convert_weight_to_int4pack + npu_weight_quant_batchmatmul (see the module docstring)."""

    def _hold(self, q: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor) -> None:
        kernel = "npu_weight_quant_batchmatmul"
        check_shape(self.out_features, self.in_features, kernel)
        if self.out_features % INT4_PER_INT32:
            raise ValueError(f"torch_npu.npu_convert_weight_to_int4pack packs the int4 weights' {self.out_features} "
                             f"outputs on this rank in groups of {INT4_PER_INT32}: not a multiple of "
                             f"{INT4_PER_INT32}; use another tensor_parallel_size or int8")
        torch_npu = import_torch_npu()  # registers the operators (engine start-up checked their schemas)

        self._npu = torch_npu
        signed = q - 8  # [out, in] int32 in [-8, 7]
        self.w = torch_npu.npu_convert_weight_to_int4pack(signed.t().contiguous())  # [in, out / 8] int32
        # a flat group (Int4Linear's scale clamped to the dtype's tiny: its weights all stand for its
        # zero, within 15 tiny): scale zero, offset 1 - its first code s0, so (s0 + 1 - s0) · zero
        flat = scales <= torch.finfo(scales.dtype).tiny
        first = signed[:, ::self.group].to(torch.float32)
        offset = torch.where(flat, 1.0 - first, zeros.float() / scales.float()).to(scales.dtype)
        self.scale = torch.where(flat, zeros, scales).t().contiguous()  # [in / group, out], the model dtype
        self.offset = offset.t().contiguous()
        self.group_size = self.group if self.in_features > self.group else 0  # one group: perchannel
        self.bias = npu_bias(self.bias, scales.dtype)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return self._npu.npu_weight_quant_batchmatmul(x, self.w, self.scale, antiquant_offset=self.offset,
                                                      bias=self.bias, antiquant_group_size=self.group_size)

    def tensors(self) -> list[torch.Tensor]:
        return [self.w, self.scale, self.offset] + ([] if self.bias is None else [self.bias])
