"""The int8 projections of the linear-layer contract (engine/lm/linear.py) on an Ascend NPU:
W8A16 (`--quantization int8`, msModelSlim "W8A16") and W8A8 dynamic (`--quantization w8a8`,
msModelSlim "W8A8_DYNAMIC"), over torch_npu's kernels. The weights and scales are the CPU ones'
(engine/lm/quant_linear.py: quantized at load, or a checkpoint's own); only how they are held and
applied differs. Not run on NPU hardware here: tested on the fake torch_npu, which computes what
op-plugin documents (tests/fakes/npu_quant_kernels_fake.py).

`NpuInt8Linear` (W8A16), as vllm-ascend `quantization/methods/w8a16.py` `AscendW8A16LinearMethod.apply`:
`torch_npu.npu_weight_quant_batchmatmul(x, weight, antiquant_scale, bias=...)` (op-plugin
docs/zh/custom_APIs/torch_npu/torch_npu-npu_weight_quant_batchmatmul.md: y = x @ ((weight +
antiquant_offset) * antiquant_scale) + bias; weight (K, N) int8). Held: `qt`, the [out, in] row-major
int8 weights' transposed view ([in, out], no copy: the document's "perchannel场景下为提高性能推荐使用
transpose后的weight输入" for an ND weight); the per-channel scales (N,) in the model dtype (it must be
x's); no offset (the weights are symmetric); the bias in fp32 for a bf16 model, fp16 for an fp16 one
(the document's bias rule).

`NpuInt8DynamicLinear` (W8A8), as vllm-ascend `quantization/methods/w8a8_dynamic.py`
`AscendW8A8DynamicLinearMethod.apply`: `torch_npu.npu_dynamic_quant(x, dst_type=torch.int8)` (per
token: scale = rowMax(|x|) / 127, y = round(x / scale); torch_npu-npu_dynamic_quant.md) then
`torch_npu.npu_quant_matmul(xq, weight, weight_scale, pertoken_scale=scale, bias=bias,
output_dtype=x.dtype)` (torch_npu-npu_quant_matmul.md: x1 @ x2 * scale * pertoken_scale + bias).
Held as its `process_weights_after_loading` holds it: the weights transposed and contiguous ([in,
out] int8; the [out, in] copy is not kept); the scales (n,) in fp32 and the bias in fp32 (the
document's table 2 takes both with a bf16 output, and with an fp16 output and pertoken_scale only
fp32 scales).

Not cast to the NZ format (vllm-ascend `maybe_trans_nz`, `torch_npu.npu_format_cast(weight, 29)`,
which it applies to int8 weights by default): npu_weight_quant_batchmatmul takes an NZ weight only
in graph mode ("当输入weight为FRACTAL_NZ格式时暂不支持单算子调用"), npu_quant_matmul takes ND weights
(NZ is documented as a transfer optimisation), and epdserve keeps `allow_internal_format = False`
(platform/npu.py); whether NZ pays here is for a measurement on hardware. Both kernels take fp16 and
bf16 activations only (an fp32 model is refused at start-up: engine/lm/linear.py `check_method`), and
K, N up to 65535 (refused at load, naming the projection's width).
"""
from __future__ import annotations

import torch

from epdserve.engine.lm.quant_linear import Int8DynamicLinear, Int8Linear
from epdserve.platform.npu import import_torch_npu

NPU_DTYPES = (torch.float16, torch.bfloat16)  # the activations both kernels take
MAX_KN = 65535  # both documents: K and N in [1, 65535]


def check_shape(out_features: int, in_features: int, kernel: str) -> None:
    if not (1 <= out_features <= MAX_KN and 1 <= in_features <= MAX_KN):
        raise ValueError(f"torch_npu.{kernel} takes K and N up to {MAX_KN}; this projection is {in_features} -> "
                         f"{out_features} on its rank: use a higher tensor_parallel_size or leave --quantization out")


def npu_bias(bias: torch.Tensor | None, dtype: torch.dtype) -> torch.Tensor | None:
    """npu_weight_quant_batchmatmul's bias dtype: fp32 for bf16 activations, fp16 for fp16 ones."""
    if bias is None:
        return None
    return bias.to(torch.float32 if dtype == torch.bfloat16 else torch.float16).contiguous()


class NpuInt8Linear(Int8Linear):
    """W8A16 on torch_npu's npu_weight_quant_batchmatmul (see the module docstring)."""

    def __init__(self, weights: list[torch.Tensor], biases: list[torch.Tensor | None] | None = None):
        super().__init__(weights, biases)
        self._place()

    @classmethod
    def prequantized(cls, qs, scales, biases, dtype) -> NpuInt8Linear:
        self = super().prequantized(qs, scales, biases, dtype)
        self._place()
        return self

    def _place(self) -> None:
        check_shape(self.out_features, self.in_features, "npu_weight_quant_batchmatmul")
        torch_npu = import_torch_npu()  # registers the operator (engine start-up checked its schema)

        self._npu = torch_npu
        self.qt = self.q.t()  # [in, out]: the transposed view of the row-major [out, in] weights
        self.bias = npu_bias(self.bias, self.scales.dtype)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return self._npu.npu_weight_quant_batchmatmul(x, self.qt, self.scales, bias=self.bias)


class NpuInt8DynamicLinear(Int8DynamicLinear):
    """W8A8 (dynamic per-token activations) on npu_dynamic_quant + npu_quant_matmul (module docstring)."""

    def _hold(self, q: torch.Tensor, scales: torch.Tensor) -> None:
        self.out_features = int(q.shape[0])
        check_shape(self.out_features, int(q.shape[1]), "npu_quant_matmul")
        torch_npu = import_torch_npu()  # registers the operators (engine start-up checked their schemas)

        self._npu = torch_npu
        self.w = q.t().contiguous()  # [in, out] int8, as vllm-ascend's process_weights_after_loading
        self.scales = scales.float().reshape(-1).contiguous()
        self.bias = None if self.bias is None else self.bias.float().contiguous()

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        xq, pertoken = self._npu.npu_dynamic_quant(x, dst_type=torch.int8)
        return self._npu.npu_quant_matmul(xq, self.w, self.scales, pertoken_scale=pertoken, bias=self.bias,
                                          output_dtype=x.dtype)

    def tensors(self) -> list[torch.Tensor]:
        return [self.w, self.scales] if self.bias is None else [self.w, self.scales, self.bias]
