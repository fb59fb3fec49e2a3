"""The int4 weight-only projection of the linear-layer contract (engine/lm/linear.py) on CUDA:
W4A16, `--quantization int4`, on a Triton kernel (ops/triton_int4_mm.py; why not torch's tinygemm
`_weight_int4pack_mm`: that module's docstring). The codes, scales and zeros are the CPU class's
(engine/lm/int4_linear.py `Int4Linear`: groups of 128 inputs, quantized at load, widths that are
not whole groups refused); only the codes' packing differs (`pack_int4`: two to a byte along the
inputs, [out, in / 2] uint8) — the scales and zeros stay one [in / 128, out, 2] tensor in the
model dtype, the bias in the model dtype. One kernel launch per call, no host read (decode graphs
capture it).

`check_cuda_int4(device, dtype)`, at start-up before any weight is read: the kernel run once on the
device (3 rows, 256 inputs: two groups, 80 outputs, a bias) against the fp32 dequantized product
within the kernel's bound; a kernel that fails to build or run, or disagrees, refuses the start and
names what to serve instead.
"""
from __future__ import annotations

import torch

from epdserve.engine.lm.cuda_quant_linear import UNIT_ROUNDOFF, refuse_or_pass
from epdserve.engine.lm.int4_linear import GROUP_SIZE, Int4Linear, quantize_int4


def int4_bound(x: torch.Tensor, q: torch.Tensor, scales_zeros: torch.Tensor, group: int,
               bias: torch.Tensor | None) -> torch.Tensor:
    """Per output element, how far the kernel may be from x · wᵀ + bias, w the fp32 dequantized
    weights of codes `q` [N, K] (ops/triton_int4_mm.py: fp32 sums of exact products, the scale and
    zero applied per group in fp32, one rounding to x's dtype, one after the bias)."""
    s, z = (scales_zeros[..., i].float().t().repeat_interleave(group, dim=1) for i in (0, 1))  # [N, K]
    p = x.float() @ dequantized(q, scales_zeros, group).t()
    mag = x.float().abs() @ ((q.float() - 8).abs() * s + z.abs()).t()
    u = UNIT_ROUNDOFF[x.dtype]
    full = p if bias is None else p + bias.float()
    return (x.shape[1] + 2) * 2.0 ** -24 * mag + (u * p.abs() + (0 if bias is None else u * full.abs())) * (1 + u)


def dequantized(q: torch.Tensor, scales_zeros: torch.Tensor, group: int) -> torch.Tensor:
    """The fp32 weights [N, K] codes `q` and `scales_zeros` stand for (before any rounding to the dtype)."""
    s, z = (scales_zeros[..., i].float().t().repeat_interleave(group, dim=1) for i in (0, 1))
    return (q.float() - 8) * s + z


class CudaInt4Linear(Int4Linear):
    """W4A16 on the Triton int4 GEMM (see the module docstring)."""

    def _hold(self, q: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor) -> None:
        from epdserve.ops.triton_int4_mm import int4_weight_mm, pack_int4  # Triton: imported only on CUDA

        self.packed = pack_int4(q)
        self.scales_zeros = torch.stack([scales, zeros], dim=-1).transpose(0, 1).contiguous()  # [in/g, out, 2]
        self._mm = int4_weight_mm

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return self._mm(x, self.packed, self.scales_zeros, self.group, self.bias)


def check_cuda_int4(device: torch.device | str, dtype: torch.dtype, kernel=None, pack=None) -> None:
    """ValueError when the int4 kernel (`kernel`, packing by `pack`: ops/triton_int4_mm.py's unless
    given) fails to run on `device` in `dtype`, or strays past its bound (module docstring)."""
    gen = torch.Generator().manual_seed(0)
    w = torch.randn(80, 2 * GROUP_SIZE, generator=gen).to(dtype)
    x = torch.randn(3, 2 * GROUP_SIZE, generator=gen).to(dtype)
    bias = torch.randn(80, generator=gen).to(dtype)
    q, scales, zeros = quantize_int4(w, GROUP_SIZE)
    sz = torch.stack([scales, zeros], dim=-1).transpose(0, 1).contiguous()

    def run():
        mm, packs = kernel, pack
        if mm is None:
            from epdserve.ops.triton_int4_mm import int4_weight_mm as mm  # ImportError: no Triton here
        if packs is None:
            from epdserve.ops.triton_int4_mm import pack_int4 as packs
        return mm(x.to(device), packs(q).to(device), sz.to(device), GROUP_SIZE, bias.to(device))

    want = x.float() @ dequantized(q, sz, GROUP_SIZE).t() + bias.float()
    refuse_or_pass("int4", device, dtype, run, want, int4_bound(x, q, sz, GROUP_SIZE, bias))
