"""Which torch_npu operators each quantized linear method calls on an NPU, and the start-up check
that the installed torch_npu registers them with the keywords epdserve passes (read from the
operators' registered schemas, ops/npu_schema.py `op_arguments`, never from `hasattr`).

The schemas, from the wheels the `[npu*]` extras install (tests/fixtures/torch_npu/<line>.txt,
extracted by scripts/npu_signatures.py from torch_npu/csrc/aten/npu_native_functions_by_codegen.yaml,
op-plugin's op_plugin/config/op_plugin_functions.yaml after codegen; the same `func:` lines are in
that yaml on op-plugin's branches 7.2.0, 7.3.0 and 26.1.0):
- `npu_weight_quant_batchmatmul(Tensor x, Tensor weight, Tensor antiquant_scale, Tensor?
  antiquant_offset=None, Tensor? quant_scale=None, Tensor? quant_offset=None, Tensor? bias=None, int
  antiquant_group_size=0, int inner_precise=0)` on 2.8.0 (op-plugin 7.2.0) and 2.9.0 (7.3.0); 2.12.0
  (26.1.0) adds `int? weight_dtype=None`;
- `npu_convert_weight_to_int4pack(Tensor weight, int inner_k_tiles=0)` on all three (int4 / W4A16:
  engine/lm/npu_int4_linear.py, which also passes npu_weight_quant_batchmatmul's antiquant_offset
  and antiquant_group_size);
- `npu_dynamic_quant(Tensor input, *, Tensor? smooth_scales=None, Tensor? group_index=None,
  ScalarType? dst_type=None) -> (Tensor, Tensor)` on 2.8.0 / 2.9.0; 2.12.0: `int? dst_type`, plus
  `str quant_mode="pertoken"`, `float dst_type_max=0.0`;
- `npu_quantize(Tensor self, Tensor scales, Tensor? zero_points, ScalarType dtype, int axis=1, bool
  div_mode=True)` (2.12.0: `int dtype`);
- `npu_quant_matmul(Tensor x1, Tensor x2, Tensor scale, *, Tensor? offset=None, Tensor?
  pertoken_scale=None, Tensor? bias=None, ScalarType? output_dtype=None, SymInt[]? group_sizes=None)`
  on 2.8.0 / 2.9.0; 2.12.0: `int? output_dtype` and more keywords (x1_dtype, x2_dtype,
  pertoken_scale_dtype, scale_dtype, y_scale). An `int` dtype argument takes a torch.dtype: torch
  binds it as its ScalarType number, and op-plugin 26.1.0's QuantMatmulKernelNpuOpApi.cpp
  `npu_quant_matmul` maps it with `c10_npu::GetAclDataType(output_dtype.value())`.
Every call epdserve makes (positional arguments and the keywords in `METHOD_OPS`) binds on all
three lines. A line without one of these operators, or without a keyword, is refused at start-up
naming the operator and the torch_npu version, before any weight is read.
"""
from __future__ import annotations

from epdserve.ops.npu_schema import NpuKernelsUnsupported, op_arguments

W8A16 = {"npu_weight_quant_batchmatmul": ("x", "weight", "antiquant_scale", "bias")}
W4A16 = {"npu_convert_weight_to_int4pack": ("weight",),
         "npu_weight_quant_batchmatmul": ("x", "weight", "antiquant_scale", "antiquant_offset", "bias",
                                          "antiquant_group_size")}
W8A8_DYNAMIC = {"npu_dynamic_quant": ("input", "dst_type"),
                "npu_quant_matmul": ("x1", "x2", "scale", "pertoken_scale", "bias", "output_dtype")}
W8A8_STATIC = {"npu_quantize": ("self", "scales", "zero_points", "dtype", "axis", "div_mode"),
               "npu_quant_matmul": ("x1", "x2", "scale", "bias", "output_dtype")}
# linear method (engine/lm/linear.py) -> {operator: the arguments epdserve's call names or fills}
METHOD_OPS = {"int8": W8A16, "w8a8": W8A8_DYNAMIC, "int4": W4A16, "w8a8-static": W8A8_STATIC,
              "ascend": {**W8A16, **W8A8_DYNAMIC, **W8A8_STATIC,
                         "npu_quant_matmul": W8A8_DYNAMIC["npu_quant_matmul"]}}


def check_quant_kernels(method: str, torch_npu) -> None:
    """Raise NpuKernelsUnsupported naming the operator (and keyword) `method`'s NPU linears call that
    the installed torch_npu does not register (torch_npu must be imported: it registers them)."""
    version = getattr(torch_npu, "__version__", "?")
    for op, names in METHOD_OPS.get(method, {}).items():
        args = op_arguments("npu", op)
        if args is None:
            raise NpuKernelsUnsupported(
                f"--quantization {method} on an NPU calls torch_npu.{op}, which torch_npu {version} does not "
                f"register: install a torch_npu line the [npu] extras name (2.8.0, 2.9.0, 2.12.0), or run on the CPU")
        missing = [n for n in names if n not in args]
        if missing:
            raise NpuKernelsUnsupported(f"--quantization {method} on an NPU calls torch_npu.{op} with {missing}, which "
                                        f"torch_npu {version}'s schema lacks")


def check_installed_quant_kernels(method: str) -> None:
    """`check_quant_kernels` against the installed torch_npu (imported here: engine start-up and
    `epdserve doctor` ask the same question)."""
    import torch_npu

    check_quant_kernels(method, torch_npu)
