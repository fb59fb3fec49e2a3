"""`PrepackedLinear`: the CPU's dense projection with its weight reordered once, at load, into
oneDNN's blocked layout, so a step's GEMM reads the weight as the kernel wants it instead of
repacking (or streaming a row-major [in, out] view) on every call.

Why: a decode step on the CPU is its GEMMs (91% of a batch-1 step under torch.profiler,
issue 50's note). On this VM (AMD EPYC, AVX2) the small demo model's 32 projections took, median
of 15: M = 1 16.8 ms with `torch.mm` on the transposed layout against 11.8 ms prepacked; M = 8
37.7 against 15.3; M = 32 51.2 against 33.0 (`python benchmarks/prepacked_gemm.py`,
benchmarks/results/prepacked-gemm-cpu.md); prefill-sized M = 256 24.2 against 18.5. vLLM's CPU
backend holds its weights the same way (its own oneDNN matmul over weights reordered at load);
torch's inductor does it under freezing (`torch/_inductor/fx_passes/mkldnn_fusion.py`:
`mkldnn._reorder_linear_weight` + `mkldnn._linear_pointwise`, the two ops used here).

A prepacked GEMM sums in oneDNN's order, not MKL's: outputs differ from `F.linear`'s by fp32
rounding (~1e-6 relative), as a tensor-parallel all-reduce's partial sums do; greedy tokens still
equal transformers' in every exactness test (run with it on). A dtype oneDNN cannot run on this
CPU (bf16 needs AVX512-BW/VL/DQ or AVX-NE-CONVERT: `mkldnn_reorder_linear_weight`'s own check;
fp16 likewise) stays `DenseLinear`; so does anything off the CPU (`usable`).
"""
from __future__ import annotations

import torch

from epdserve.engine.lm.fusion import fuse


def usable(dtype: torch.dtype, device: torch.device | str = "cpu") -> bool:
    """Whether oneDNN can hold and apply a `dtype` weight on this CPU."""
    if torch.device(device).type != "cpu" or not torch.backends.mkldnn.is_available():
        return False
    if dtype == torch.float32:
        return True
    if dtype == torch.bfloat16:
        return bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())
    if dtype == torch.float16:
        return bool(torch.ops.mkldnn._is_mkldnn_fp16_supported())
    return False


class PrepackedLinear:
    """A fused dense projection whose weight oneDNN holds in its own (opaque) layout."""

    def __init__(self, weights: list[torch.Tensor], biases: list[torch.Tensor | None] | None = None):
        """`weights`: the fused parts' [out_i, in] tensors; `biases`: theirs (as `DenseLinear`)."""
        w, self.bias = fuse(weights, biases)
        self.out_features = int(w.shape[0])
        self.weight = torch.ops.mkldnn._reorder_linear_weight(w.contiguous())

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return torch.ops.mkldnn._linear_pointwise(x, self.weight, self.bias, "none", [], "")

    def tensors(self) -> list[torch.Tensor]:
        return [self.weight] if self.bias is None else [self.weight, self.bias]
