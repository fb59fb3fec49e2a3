"""The int8 weight-only projection of the linear-layer contract (engine/lm/linear.py) on CUDA:
W8A16, `--quantization int8`, on a Triton kernel (ops/triton_int8_mm.py; why not torch's own
`_weight_int8pack_mm` CUDA kernel: that module's docstring). The weights, scales and bias are the
CPU class's (engine/lm/quant_linear.py `Int8Linear`: quantized at load, or a checkpoint's own
W8A16), held the same way — q [out, in] row-major int8, scales [out] and the bias in the model
dtype — so only the call differs: one kernel launch at every row count (no chunked fallback), no
host read, so decode graphs capture it.

`check_cuda_int8(device, dtype)`, at start-up before any weight is read (as engine/lm/fp8_device.py
checks `_scaled_mm`): the kernel compiled and run once on the device at a small shape that crosses
block edges (3 rows, 200 inputs, 80 outputs, a bias) against the dequantized float product within
the kernel's bound; a kernel that fails to build or run, or disagrees, refuses the start and names
what to serve instead (`refuse_or_pass`, which engine/lm/cuda_int4_linear.py's int4 check shares).
"w8a8" has no CUDA kernel here (engine/lm/linear.py refuses it).
"""
from __future__ import annotations

import torch

from epdserve.engine.lm.quant_linear import Int8Linear, quantize_int8

UNIT_ROUNDOFF = {torch.float32: 2.0 ** -24, torch.bfloat16: 2.0 ** -8, torch.float16: 2.0 ** -11}


def int8_bound(x: torch.Tensor, q: torch.Tensor, scales: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """Per output element, how far the kernel may be from the dequantized float product plus bias
    (ops/triton_int8_mm.py: K fp32 additions, one rounding to x's dtype after the scale, one after
    the bias), with one more fp32 unit of slack on the sum."""
    w = q.float() * scales.float()[:, None]
    p = x.float() @ w.t()
    s = x.float().abs() @ w.abs().t()
    u = UNIT_ROUNDOFF[x.dtype]
    full = p if bias is None else p + bias.float()
    return (x.shape[1] + 1) * 2.0 ** -24 * s + (u * p.abs() + (0 if bias is None else u * full.abs())) * (1 + u)


class CudaInt8Linear(Int8Linear):
    """W8A16 on the Triton int8 GEMM (see the module docstring)."""

    def __init__(self, weights: list[torch.Tensor], biases: list[torch.Tensor | None] | None = None):
        super().__init__(weights, biases)
        self._bind()

    @classmethod
    def prequantized(cls, qs, scales, biases, dtype) -> CudaInt8Linear:
        self = super().prequantized(qs, scales, biases, dtype)
        self._bind()
        return self

    def _bind(self) -> None:
        from epdserve.ops.triton_int8_mm import int8_weight_mm  # Triton: imported only on CUDA

        self._mm = int8_weight_mm

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return self._mm(x, self.q, self.scales, self.bias)


def refuse_or_pass(method: str, device, dtype: torch.dtype, run, want: torch.Tensor, bound: torch.Tensor) -> None:
    """The start-up verdict on `method`'s CUDA kernel: ValueError naming what to serve instead when
    `run()` raises, or its output (moved to the CPU) is off `want` by more than `bound` anywhere (NaN too)."""
    others = "int8, " if method != "int8" else ""
    fix = (f"serve --quantization {others}fp8 (compute capability >= 8.9) or leave --quantization out (bf16), or "
           f"run on the CPU")
    try:
        got = run().float().cpu()
    except Exception as e:
        raise ValueError(f"the {method} Triton kernel does not run on {device} ({type(e).__name__}: "
                         f"{str(e).splitlines()[0] if str(e) else ''}): {fix}") from e
    if not (got.shape == want.shape and bool(((got - want).abs() <= bound).all())):
        raise ValueError(f"the {method} Triton kernel's product on {device} ({dtype}) differs from the dequantized "
                         f"float product past its bound: {fix}")


def check_cuda_int8(device: torch.device | str, dtype: torch.dtype, kernel=None) -> None:
    """ValueError when the int8 kernel (`kernel`: ops/triton_int8_mm.py `int8_weight_mm` unless
    given) fails to run on `device` in `dtype`, or strays past its bound (module docstring)."""
    gen = torch.Generator().manual_seed(0)
    w = torch.randn(80, 200, generator=gen).to(dtype)
    x = torch.randn(3, 200, generator=gen).to(dtype)
    bias = torch.randn(80, generator=gen).to(dtype)
    q, scales = quantize_int8(w)

    def run():
        mm = kernel
        if mm is None:
            from epdserve.ops.triton_int8_mm import int8_weight_mm as mm  # ImportError: no Triton here
        return mm(x.to(device), q.to(device), scales.to(device), bias.to(device))

    want = x.float() @ (q.float() * scales.float()[:, None]).t() + bias.float()
    refuse_or_pass("int8", device, dtype, run, want, int8_bound(x, q, scales, bias))
