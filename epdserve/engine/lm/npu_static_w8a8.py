"""msModelSlim's static W8A8 projection (engine/lm/static_w8a8.py, the format and its arithmetic) on
an Ascend NPU, as vllm-ascend runs it: `quantization/methods/w8a8_static.py`
`AscendW8A8LinearMethod.apply` quantizes the activations with `torch.ops.vllm.quantize`, which is
`torch_npu.npu_quantize(x, input_scale_reciprocal, input_offset, torch.qint8, -1, False)`
(`ops/register_custom_ops.py` `_quantize_impl`: div_mode False, "aclnnAscendQuantV3(npu_quantize)
use div_mode=False"), then calls `torch_npu.npu_quant_matmul(x, weight, deq_scale, bias=quant_bias,
output_dtype=...)`.

The kernels (op-plugin docs/zh/custom_APIs/torch_npu/): torch_npu-npu_quantize.md, div_mode False:
x * scales + zero_points, qint8 out, scales and zero_points of x's dtype, 1-D of the quantized
(last, axis -1) dim's size; torch_npu-npu_quant_matmul.md with an int32 bias: (x1 @ x2 + bias) *
scale, rounded to output_dtype (table 2: int8 x1 / x2, fp32 scale, int32 bias, no pertoken_scale:
a bf16 or fp16 output).

Held per run of parts sharing one input scale and offset (`runs`), as `process_weights_after_loading`
holds them: the reciprocal of the input scale and the offset, each repeated over the inputs
(`aclnn_input_scale_reciprocal`, `aclnn_input_offset`) in the model dtype; the int8 weights
transposed and contiguous ([in, out]; not cast to NZ: engine/lm/npu_quant_linear.py says why);
deq_scale fp32 (n,); quant_bias int32 (n,), or none on a rank > 0 of a projection split by its
inputs. The reciprocal is rounded to the model dtype (the CPU path keeps it in fp32), so an input
within a rounding of a quantization step's edge may land one step apart on the two platforms.
"""
from __future__ import annotations

import torch

from epdserve.engine.lm.npu_quant_linear import check_shape
from epdserve.engine.lm.static_w8a8 import StaticPart, StaticW8A8Linear, quant_bias, runs
from epdserve.platform.npu import import_torch_npu


class _NpuRun:
    """Consecutive parts sharing one (input scale, offset): one npu_quantize and one npu_quant_matmul."""

    def __init__(self, parts: list[StaticPart], dtype: torch.dtype):
        q = torch.cat([p.q for p in parts])
        check_shape(int(q.shape[0]), int(q.shape[1]), "npu_quant_matmul")
        k = int(q.shape[1])
        recip = torch.tensor(1.0, dtype=torch.float32) / torch.tensor(parts[0].input_scale, dtype=torch.float32)
        self.recip = recip.to(dtype).repeat(k).to(q.device)
        self.offset = torch.full((k,), float(parts[0].input_offset), dtype=dtype, device=q.device)
        self.w = q.t().contiguous()  # [in, out] int8
        self.deq = torch.cat([p.deq_scale.float().reshape(-1) for p in parts]).contiguous()
        self.bias = quant_bias(parts)

    def __call__(self, npu, x: torch.Tensor) -> torch.Tensor:
        xq = npu.npu_quantize(x, self.recip, self.offset, torch.qint8, -1, False)
        return npu.npu_quant_matmul(xq, self.w, self.deq, bias=self.bias, output_dtype=x.dtype)

    def tensors(self) -> list[torch.Tensor]:
        return [self.w, self.deq, self.recip, self.offset] + ([] if self.bias is None else [self.bias])


class NpuStaticW8A8Linear(StaticW8A8Linear):
    """msModelSlim static W8A8 on torch_npu (see the module docstring); `dtype`: the model's (fp16 / bf16)."""

    def __init__(self, parts: list[StaticPart], dtype: torch.dtype):
        torch_npu = import_torch_npu()  # registers the operators (engine start-up checked their schemas)

        self._npu = torch_npu
        self.runs = [_NpuRun(run, dtype) for run in runs(parts)]
        self.out_features = sum(int(p.q.shape[0]) for p in parts)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        outs = [r(self._npu, x) for r in self.runs]
        return outs[0] if len(outs) == 1 else torch.cat(outs, dim=1)

    def tensors(self) -> list[torch.Tensor]:
        return [t for r in self.runs for t in r.tensors()]
