"""The aten operators our models launch on an NPU, the route op-plugin takes for each and what is
known of the kernel behind it — the classification behind ops/npu_core_limits.py (table and
citations: docs/npu-colocation.md, "The model's aten operators").

Route (Ascend/op-plugin 7.2.0, 7.3.0, 26.1.0): op_plugin_functions.yaml lists every operator below
with both `op_api` and `acl_op`; the generated dispatcher (codegen/gen.py on 7.x,
torchnpugen/gen.py on 26.1.0, the `"op_api" in f.impl_ns and "acl_op" in f.impl_ns` branch) calls
op_api:: (aclnn) when `at_npu::native::env::CheckJitDisable()` and the inputs are in base format,
else acl_op:: (the aclop/TBE path). CheckJitDisable (Ascend/pytorch
torch_npu/csrc/framework/interface/EnvVariables.cpp CheckJitDisableInner, v2.8.0-7.2.0 and
v2.12.0-26.1.0) is true unless jit_compile is set, on every SoC from Ascend910B1 on (A2, A3); we
keep `allow_internal_format = False`. Inside op_api, `DO_COMPATIBILITY(aclnnX, acl_op::...)`
(op_plugin/utils/op_api_common.h) falls back to acl_op only where libopapi lacks aclnnX. So on
A2 / A3 every operator here runs its aclnn API.

Kernel: whether a core limit binds it depends on the kernel the aclnn API launches being Ascend C
(op-plugin torch_npu-set_stream_limit.md). hicann/ops-nn (e5c3fa9) registers Ascend C kernels for
ascend910b / ascend910_93 (`AddConfig` in op_host/*_def.cpp) for MatMulV3, BatchMatMulV3,
LayerNormV4, RmsNorm; but aclnnMm / aclnnMatmul pick MatMulV3 or the older MatMul (V2) per shape
and dtype (matmul/common/op_host/op_api/matmul_util.cpp), and the elementwise, reduction, index
and softmax kernels' Ascend C sources in hicann/ops-math (c419332) and ops-nn register only
ascend950 — their A2 / A3 kernels are not in these repositories, so their language is not shown.
Several aclnn APIs also fall back to AI CPU for some dtypes (e.g. ops-math math/add/op_api/add.cpp
AddAiCpu). Hence every operator here is UNKNOWN: the limit is set (none is known to ignore it)
and the warning names them, to be measured (`epdserve bench colocation --device npu`).
"""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class AtenRoute:
    aten: str
    aclnn: str  # the aclnn API op-plugin's op_api implementation calls (EXEC_NPU_CMD / gen_opapi exec)
    opapi: str  # op_plugin/ops/opapi file, or the yaml's gen_opapi entry
    kernel: str  # what the CANN operator sources show of the kernel on A2 / A3


_ELEMENTWISE = "A2/A3 kernel not in hicann/ops-math (its Ascend C kernel registers ascend950 only)"
_NN = "A2/A3 kernel not in hicann/ops-nn (its Ascend C kernel registers ascend950 only)"
_MATMUL = "MatMulV3 (Ascend C, ascend910b/910_93) or MatMul V2 per shape (matmul_util.cpp)"

ROUTES = {r.aten: r for r in (
    AtenRoute("mm", "aclnnMm", "MmKernelNpuOpApi.cpp", _MATMUL),
    AtenRoute("addmm", "aclnnAddmm", "AddmmKernelNpuOpApi.cpp", _MATMUL),
    AtenRoute("bmm", "aclnnBatchMatMul", "BmmKernelNpuOpApi.cpp", "BatchMatMulV3 (Ascend C) registers ascend910b; aclnnBatchMatMul's choice not read"),
    AtenRoute("matmul", "aclnnMatmul", "MatmulKernelNpuOpApi.cpp", _MATMUL),
    AtenRoute("pow", "aclnnPowTensorScalar", "yaml gen_opapi pow.Tensor_Scalar_out", _ELEMENTWISE),
    AtenRoute("mean", "aclnnMean", "MeanKernelNpuOpApi.cpp", _ELEMENTWISE + " (ReduceMean)"),
    AtenRoute("rsqrt", "aclnnRsqrt", "yaml gen_opapi rsqrt", _ELEMENTWISE),
    AtenRoute("mul", "aclnnMul / aclnnMuls", "MulKernelNpuOpApi.cpp", _ELEMENTWISE),
    AtenRoute("add", "aclnnAdd / aclnnAdds", "AddKernelNpuOpApi.cpp", _ELEMENTWISE + "; AI CPU for some dtypes"),
    AtenRoute("silu", "aclnnSilu", "yaml gen_opapi silu.out", _NN + " (Swish)"),
    AtenRoute("sigmoid", "aclnnSigmoid", "yaml gen_opapi sigmoid", _NN),
    AtenRoute("gelu", "aclnnGelu", "yaml gen_opapi gelu (7.x); 26.1.0 lists only gelu.out", _NN),
    AtenRoute("cat", "aclnnCat", "CatKernelNpuOpApi.cpp", _ELEMENTWISE + " (Concat)"),
    AtenRoute("neg", "aclnnNeg", "yaml gen_opapi neg.out", _ELEMENTWISE),
    AtenRoute("cos", "aclnnCos", "yaml gen_opapi cos", _ELEMENTWISE),
    AtenRoute("sin", "aclnnSin", "yaml gen_opapi sin", _ELEMENTWISE),
    AtenRoute("index", "aclnnIndex", "IndexKernelNpuOpApi.cpp", _NN),
    AtenRoute("gather", "aclnnGather", "GatherKernelNpuOpApi.cpp", _NN),
    AtenRoute("index_select", "aclnnIndexSelect", "IndexSelectKernelNpuOpApi.cpp", _NN + " (GatherV2)"),
    AtenRoute("embedding", "aclnnEmbedding", "EmbeddingKernelNpuOpApi.cpp", _NN),
    AtenRoute("_softmax", "aclnnSoftmax", "yaml gen_opapi _softmax", _NN + " (SoftmaxV2)"),
    AtenRoute("convolution", "aclnnConvolution", "ConvolutionKernelNpuOpApi.cpp",
              "Conv3DV2 registers ascend910b; aclnn_convolution.cpp picks per SoC / shape (not traced)"),
    AtenRoute("native_layer_norm", "aclnnLayerNorm", "LayerNormKernelNpuOpApi.cpp",
              "LayerNormV4 (Ascend C) registers ascend910b; aclnnLayerNorm's choice not read"),
)}

# transformers' Qwen2-VL / Qwen2.5-VL on the stage's path: linear -> mm / addmm / matmul; RMSNorm
# as pow, mean, rsqrt, mul; rotary as cos, sin, mul, neg, cat, add; Qwen2-VL's vision MLP QuickGELU
# as sigmoid and mul; the merger's GELU; the patch embed's Conv3d; sampling's softmax and gather.
VISION = ("convolution", "mm", "addmm", "matmul", "native_layer_norm", "pow", "mean", "rsqrt", "mul", "add",
          "sigmoid", "silu", "gelu", "cos", "sin", "neg", "cat", "bmm", "_softmax", "index")
LANGUAGE = ("embedding", "mm", "addmm", "matmul", "pow", "mean", "rsqrt", "mul", "add", "silu", "cos", "sin",
            "neg", "cat", "index", "index_select", "gather", "_softmax")
