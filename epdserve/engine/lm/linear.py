"""The linear-layer contract: how one projection of the LM holds its weights and is applied —
the one place a tensor-parallel shard, and later a quantized or prepacked weight, plugs in.

A projection is a `Linear`: `linear(x)` maps [tokens, in] to [tokens, out] and `tensors()` lists
what it holds (the forward's graph capture and parameter count read them). It is built from the
checkpoint's own tensors by its `method` (`LINEAR_METHODS`), given the parts it fuses (QKV's
three, gate-up's two, or one) already cut to the rank's slice (engine/lm/shard_loader.py, or
transformers' modules at tensor_parallel_size 1): a method sees whole [out, in] weights of its
rank and decides how to hold them. `DenseLinear` ("dense", the default): the weights in the
model dtype, fused and stored transposed ([in, out] views of row-major [out, in] tensors) so a
call is one `mm` / `addmm` with no per-call transpose; on the CPU "dense" is `PrepackedLinear`
(engine/lm/prepacked_linear.py: the same fused weight reordered once for oneDNN) wherever oneDNN
runs the dtype. `Int8Linear` ("int8",
engine/lm/quant_linear.py): int8 weights per output channel, quantized from the rank's slice at
load, applied by torch's int8 CPU kernel; `Int8DynamicLinear` ("w8a8"): the same weights with
each token's activations quantized to int8 at run time, an int8 GEMM; `Int4Linear` ("int4",
engine/lm/int4_linear.py): 4-bit weights in groups of 128 inputs (W4A16); `StaticW8A8Linear`
("w8a8-static", engine/lm/static_w8a8.py): msModelSlim's static W8A8, built only from such a
checkpoint's own tensors (engine/lm/shard_loader.py), never quantized at load; `Fp8Linear`
("fp8", engine/lm/fp8_linear.py): float8_e4m3fn weights and per-token activations, one
`torch._scaled_mm`, on CPU and CUDA (compute capability >= 8.9: engine/lm/fp8_device.py) —
quantized at load, or a compressed-tensors FP8 checkpoint's own ("compressed-tensors",
engine/lm/fp8_checkpoint.py). `check_method` refuses, before any weight is read, a method the
platform has no kernel for.

The class holding a method's weights is the platform's (`linear_class`, decided at load by the
engine's platform): on an NPU "int8", "w8a8", "w8a8-static" and "ascend" run on torch_npu's
kernels (engine/lm/npu_quant_linear.py, npu_static_w8a8.py: the same weights and scales, held as
those kernels take them), and so does "int4" (engine/lm/npu_int4_linear.py: the same codes, scales
and zeros on npu_weight_quant_batchmatmul over `npu_convert_weight_to_int4pack` weights), fp16 /
bf16 models only; FP8 runs on the CPU and CUDA. On CUDA "int8" runs on a Triton W8A16 kernel
(engine/lm/cuda_quant_linear.py, ops/triton_int8_mm.py: the same weights and scales) and "int4" on
a Triton W4A16 kernel (engine/lm/cuda_int4_linear.py, ops/triton_int4_mm.py: the same codes, scales
and zeros, the codes packed for it), each checked on the device at start-up; "w8a8" has no CUDA
kernel here and is refused there, naming int8, int4 and fp8 instead. On the CPU every method is as
it was.
"""
from __future__ import annotations

from typing import Protocol

import torch

from epdserve.engine.lm.cuda_int4_linear import CudaInt4Linear, check_cuda_int4
from epdserve.engine.lm.cuda_quant_linear import CudaInt8Linear, check_cuda_int8
from epdserve.engine.lm.fp8_linear import Fp8Linear
from epdserve.engine.lm.fusion import fuse
from epdserve.engine.lm.int4_linear import Int4Linear
from epdserve.engine.lm.npu_int4_linear import NpuInt4Linear
from epdserve.engine.lm.npu_quant_linear import NPU_DTYPES, NpuInt8DynamicLinear, NpuInt8Linear
from epdserve.engine.lm.npu_static_w8a8 import NpuStaticW8A8Linear
from epdserve.engine.lm.prepacked_linear import PrepackedLinear, usable as prepack_usable
from epdserve.engine.lm.quant_linear import Int8DynamicLinear, Int8Linear
from epdserve.engine.lm.static_w8a8 import StaticPart, StaticW8A8Linear


class Linear(Protocol):
    out_features: int

    def __call__(self, x: torch.Tensor) -> torch.Tensor: ...

    def tensors(self) -> list[torch.Tensor]: ...


class DenseLinear:
    """Weights in the model dtype, [in, out] (transposed views), bias or None."""

    def __init__(self, weights: list[torch.Tensor], biases: list[torch.Tensor | None] | None = None):
        """`weights`: the fused parts' [out_i, in] tensors, concatenated on out; `biases`: theirs
        (a part without one adds zeros; all None: no bias)."""
        w, self.bias = fuse(weights, biases)
        self.t = w.t()
        self.out_features = int(w.shape[0])

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return torch.mm(x, self.t) if self.bias is None else torch.addmm(self.bias, x, self.t)

    def tensors(self) -> list[torch.Tensor]:
        return [self.t] if self.bias is None else [self.t, self.bias]


LINEAR_METHODS = {"dense": DenseLinear, "int8": Int8Linear, "w8a8": Int8DynamicLinear,
                  "int4": Int4Linear, "fp8": Fp8Linear}  # name -> its Linear
# the NPU's classes for the methods it runs (the same weights, held as torch_npu's kernels take them)
NPU_LINEAR_METHODS = {"int8": NpuInt8Linear, "w8a8": NpuInt8DynamicLinear, "int4": NpuInt4Linear}
# CUDA's classes for the methods it runs on Triton kernels (the same weights; engine/lm/cuda_quant_linear.py,
# cuda_int4_linear.py)
CUDA_LINEAR_METHODS = {"int8": CudaInt8Linear, "int4": CudaInt4Linear}
CUDA_CHECKS = {"int8": check_cuda_int8, "int4": check_cuda_int4}  # each one's kernel run once on the device at start-up
# a quantized method -> the platforms with its kernel ("w8a8-static" and "ascend": an msModelSlim
# checkpoint's own, engine/lm/prequantized.py; "compressed-tensors": an FP8 checkpoint's own,
# engine/lm/fp8_checkpoint.py)
METHOD_PLATFORMS = {"int8": ("cpu", "npu", "cuda"), "w8a8": ("cpu", "npu"), "int4": ("cpu", "npu", "cuda"),
                    "w8a8-static": ("cpu", "npu"), "ascend": ("cpu", "npu"), "fp8": ("cpu", "cuda"),
                    "compressed-tensors": ("cpu", "cuda")}
METHOD_KERNELS = {"int8": "torch's _weight_int8pack_mm CPU kernel; torch_npu.npu_weight_quant_batchmatmul; a Triton "
                          "kernel on CUDA",
                  "w8a8": "torch's _int_mm CPU kernel; torch_npu.npu_dynamic_quant + npu_quant_matmul; no CUDA "
                          "kernel here yet: on CUDA use int8 or int4 (weight-only) or fp8",
                  "int4": "torch's _weight_int4pack_mm_for_cpu kernel; torch_npu.npu_convert_weight_to_int4pack + "
                          "npu_weight_quant_batchmatmul; a Triton kernel on CUDA",
                  "w8a8-static": "torch's _int_mm CPU kernel; torch_npu.npu_quantize + npu_quant_matmul",
                  "ascend": "torch's int8 CPU kernels; torch_npu's quantized matmuls",
                  "fp8": "torch's _scaled_mm (CPU; CUDA compute capability >= 8.9)",
                  "compressed-tensors": "torch's _scaled_mm (CPU; CUDA compute capability >= 8.9)"}


CHECKPOINT_LINEARS = {"w8a8-static": StaticW8A8Linear}  # built from a checkpoint's own tensors only


def method_of(linear) -> str:
    """The method name a built projection runs (the inverse of `LINEAR_METHODS`, `CHECKPOINT_LINEARS`)."""
    if isinstance(linear, PrepackedLinear):
        return "dense"
    return next((name for name, cls in {**LINEAR_METHODS, **CHECKPOINT_LINEARS}.items() if isinstance(linear, cls)),
                type(linear).__name__)


def check_method(quantization: str | None, platform: str, dtype: torch.dtype | None = None) -> str:
    """The method `quantization` names ("dense" for None); ValueError for an unknown one, one
    `platform` ("cpu", "cuda", "npu") has no kernel for, or (given the model's `dtype`) an NPU
    quantized method in a dtype torch_npu's kernels do not take (fp16 / bf16 only)."""
    if quantization is None:
        return "dense"
    if quantization not in METHOD_PLATFORMS:
        raise ValueError(f"unknown quantization {quantization!r}; known: {', '.join(METHOD_PLATFORMS)}")
    if platform not in METHOD_PLATFORMS[quantization]:
        raise ValueError(f"quantization={quantization} runs on {', '.join(METHOD_PLATFORMS[quantization])} only "
                         f"({METHOD_KERNELS[quantization]}), not on {platform}")
    if platform == "npu" and dtype is not None and dtype not in NPU_DTYPES:
        raise ValueError(f"quantization={quantization} on an NPU runs torch_npu's quantized matmuls, which take fp16 "
                         f"or bf16 activations only, not {dtype}: use --dtype bfloat16 or float16")
    return quantization


def linear_class(method: str, platform: str = "cpu"):
    """The class holding `method`'s projections on `platform` (the NPU's and CUDA's for the methods
    they run on kernels of their own)."""
    if platform == "npu" and method in NPU_LINEAR_METHODS:
        return NPU_LINEAR_METHODS[method]
    if platform == "cuda" and method in CUDA_LINEAR_METHODS:
        return CUDA_LINEAR_METHODS[method]
    try:
        return LINEAR_METHODS[method]
    except KeyError:
        raise ValueError(f"unknown linear method {method!r}; known: {', '.join(LINEAR_METHODS)}") from None


def static_linear(parts: list[StaticPart], dtype: torch.dtype, platform: str = "cpu") -> Linear:
    """msModelSlim static W8A8 parts held for `platform` (engine/lm/static_w8a8.py, npu_static_w8a8.py)."""
    return NpuStaticW8A8Linear(parts, dtype) if platform == "npu" else StaticW8A8Linear(parts)


def make_linear(weights: list[torch.Tensor], biases: list[torch.Tensor | None] | None = None,
                method: str = "dense", platform: str = "cpu") -> Linear:
    """The projection fusing `weights` (each [out_i, in], the rank's slice) by `method`, held for `platform`
    ("dense" on the CPU: prepacked for oneDNN where it runs the dtype, engine/lm/prepacked_linear.py)."""
    if method == "dense" and platform == "cpu" and prepack_usable(weights[0].dtype, weights[0].device):
        return PrepackedLinear(weights, biases)
    return linear_class(method, platform)(weights, biases)
