"""Paged-KV attention operators and an LM layer's fused operators, one implementation per platform
behind one interface each.

One sentence per module:
- backend.py          `PagedOps`: the three paged-KV operators attention needs, the interface
- select.py           `paged_ops(platform)`, `layer_ops(platform)`: which implementation an engine uses
- layer_ops.py        `LayerOps`: an LM layer's fused element-wise operators, and `PortableLayerOps` in plain torch
- native_layer_ops.py `NativeLayerOps`: those as csrc/ C++ CPU kernels, one operator per call, torch's arithmetic
- portable.py         `PortableOps`: plain torch on any device (gather the blocks, then SDPA)
- triton_ops.py       `TritonOps`: CUDA's — decode attention and the KV write as Triton kernels, prefill chunks portable
- triton_decode.py    the Triton paged decode-attention kernel (reads K/V through the block table; CPU: Triton's interpreter)
- triton_layer_ops.py `TritonLayerOps`: CUDA's LayerOps as Triton kernels, and their start-up check against the portable ops
- triton_layer.py     the Triton kernels: add + RMSNorm, RMSNorm, rotary (q and k in one launch), SiLU-and-mul, the KV write
- triton_int8_mm.py   the Triton W8A16 GEMM: int8 weights per output channel dequantized in the kernel (CUDA's int8 linear)
- triton_int4_mm.py   the Triton W4A16 GEMM: 4-bit codes in groups of 128 with a scale and zero (CUDA's int4 linear)
- native.py           `NativeOps`: the csrc/ C++ operators (`torch.ops.epdserve.*`), built on first use
- native_build.py     building csrc/: torch's C++-extension JIT, cached per torch version and source hash
- build_progress.py   what a user waiting on the first native build sees on stderr
- npu_ops.py          `NpuPagedOps`: the operators on Ascend NPUs over torch_npu's kernels
- npu_graph_fia.py    `FiaGraphTasks`: a decode graph's FIA launches as task groups, re-issued with each step's lengths
- npu_schema.py       which KV-write call the installed torch_npu's operator schemas allow, probed once
- npu_quant_schema.py which torch_npu operators each quantized linear method calls, checked against the schemas at start-up
- npu_attention_check.py  at start-up: whether this CANN's attention kernel takes the model (bf16, head_dim) and our call
- npu_core_limits.py  which operators each NPU stage launches and whether a core limit binds them
- npu_aten_routes.py  the aten operators our models launch on an NPU: op-plugin's route (aclnn) and what is known of the kernel
- attention_meta.py   per-step attention metadata of a packed, variable-length batch; `StepPacker`, the one upload's layout
- paged_attention.py  `paged_attend`: one layer's cache write + attention for a packed batch
- npu_layer_ops.py    `NpuLayerOps`: the LayerOps contract over torch_npu's fused kernels (add_rms_norm, rms_norm, rotary_mul, swiglu)
"""
