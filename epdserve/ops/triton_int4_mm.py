"""The W4A16 GEMM as one Triton kernel: activations x [M, K] (fp32, bf16 or fp16) times 4-bit
weights in groups of `group` inputs, each group with a scale and a zero per output channel,
accumulated in fp32, output in x's dtype, a bias added — what `Int4Linear` (engine/lm/int4_linear.py)
computes, on CUDA (engine/lm/cuda_int4_linear.py holds the weights and checks this kernel at start-up).

Why Triton and not torch's own op: torch registers a CUDA kernel for `_weight_int4pack_mm`
(native_functions.yaml: `CUDA: _weight_int4pack_mm_cuda`, the tinygemm kernel, with
`_convert_weight_to_int4pack` `CUDA: _convert_weight_to_int4pack_cuda` to pack for it; read in the
torch 2.13 native_functions.yaml installed here), but it takes bf16 activations only on compute
capability >= 8.0 (aten/src/ATen/native/cuda/int4mm.cu `_weight_int4pack_mm_cuda`:
`TORCH_CHECK(A.dtype() == at::kBFloat16)`, the kernel built for `__CUDA_ARCH__ >= 800`; read in a
copy of the file, not at the v2.11.0 tag), and its packing op has no CPU kernel
(`_convert_weight_to_int4pack_for_cpu` packs another layout): nothing of it can run in this
project's CPU tests, and fp16 / fp32 models would need a second route. This kernel takes all three
dtypes and runs in Triton's interpreter.

Layout (chosen for this kernel): the 4-bit codes q (0..15) two to a byte along K, [N, K / 2] uint8,
the even input in the low nibble (`pack_int4`); K is the contiguous axis of x and of the codes, so
each output channel's codes are one contiguous run (decode reads them as a stream). Scales and
zeros are the CPU class's one [K / group, N, 2] tensor in the model dtype ([group, channel,
scale|zero]): one K tile is one group, and its scales and zeros for a block of N channels are
adjacent.

Arithmetic: the weight a code stands for is (q - 8) · scale + zero (engine/lm/int4_linear.py). Per
group g, sum_k x_k ((q_k - 8) s + z) = s · sum_k x_k (q_k - 8) + z · sum_k x_k: `tl.dot` of x with
the codes less 8 (-8..7: exact in every dtype, so the products are exact) in fp32, and x's row sums
in fp32; then s and z applied in fp32 and added to the fp32 accumulator. The result is rounded
once to x's dtype; a bias is added in fp32 and rounded again — the CPU class's two roundings
(`_weight_int4pack_mm_for_cpu` then `add_(bias)`). Rounding to bf16 on the bits and fp32 operands
in the interpreter as ops/triton_int8_mm.py does. Bound against p = x · wᵀ with w the fp32
dequantized weights, u the dtype's unit roundoff, S = |x| · (|q - 8| · s + |z|)ᵀ, b the bias:
    |out - (p + b)| <= (K + 2) · 2^-24 · S  +  u · |p|  +  u · |p + b|   (to first order, with slack)

No host reads; the grid and blocks follow from the shapes alone (decode graphs replay it). K must
be a multiple of `group` (Int4Linear refuses other widths at load). Imported only when used.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from epdserve.ops.triton_int8_mm import DTYPES, block_m
from epdserve.ops.triton_layer import _ROUND, INTERPRETED, _round

BLOCK_N = 64  # untuned: no GPU measured this kernel yet


def pack_int4(q: torch.Tensor) -> torch.Tensor:
    """Codes `q` [N, K] (0..15, K even) two to a byte: [N, K / 2] uint8, input 2i low, 2i + 1 high."""
    q = q.to(torch.uint8)
    return (q[:, 0::2] | (q[:, 1::2] << 4)).contiguous()


@triton.jit
def _int4_mm_kernel(x_ptr, p_ptr, sz_ptr, b_ptr, o_ptr, M, N, K,
                    sxm, sxk, spn, spk, szg, szn, som, son,
                    HAS_BIAS: tl.constexpr, O_ROUND: tl.constexpr, PRECISION: tl.constexpr, WIDEN: tl.constexpr,
                    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, GROUP: tl.constexpr):
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, GROUP)
    m_ok = offs_m < M
    n_ok = offs_n < N
    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    for g in range(0, K // GROUP):
        k = g * GROUP + offs_k
        x = tl.load(x_ptr + offs_m[:, None] * sxm + k[None, :] * sxk, mask=m_ok[:, None], other=0.0)
        byte = tl.load(p_ptr + offs_n[None, :] * spn + (k // 2)[:, None] * spk, mask=n_ok[None, :], other=0)
        code = ((byte.to(tl.int32) >> ((k % 2) * 4)[:, None]) & 0xF) - 8  # [GROUP, BLOCK_N], -8..7
        xf = x.to(tl.float32)
        if WIDEN:  # the interpreter's bf16 dot is wrong; fp32 operands give the same exact products
            part = tl.dot(xf, code.to(tl.float32), input_precision="ieee")
        else:
            part = tl.dot(x, code.to(x.dtype), input_precision=PRECISION)
        xsum = tl.sum(xf, axis=1)
        s = tl.load(sz_ptr + g * szg + offs_n * szn, mask=n_ok, other=0.0).to(tl.float32)
        z = tl.load(sz_ptr + g * szg + offs_n * szn + 1, mask=n_ok, other=0.0).to(tl.float32)
        acc += part * s[None, :] + xsum[:, None] * z[None, :]
    y = _round(acc, O_ROUND)
    if HAS_BIAS:
        bias = tl.load(b_ptr + offs_n, mask=n_ok, other=0.0).to(tl.float32)
        y = _round(y + bias[None, :], O_ROUND)
    tl.store(o_ptr + offs_m[:, None] * som + offs_n[None, :] * son, y.to(o_ptr.dtype.element_ty),
             mask=m_ok[:, None] & n_ok[None, :])


def int4_weight_mm(x: torch.Tensor, packed: torch.Tensor, scales_zeros: torch.Tensor, group: int,
                   bias: torch.Tensor | None = None) -> torch.Tensor:
    """[M, N] in x's dtype: x [M, K] times the codes `packed` [N, K / 2] (`pack_int4`) with
    `scales_zeros` [K / group, N, 2] (last dim contiguous), plus `bias` [N] (module docstring)."""
    if x.dtype not in DTYPES:
        raise ValueError(f"the int4 Triton GEMM takes fp32, bf16 or fp16 activations, not {x.dtype}")
    M, K = x.shape
    N = packed.shape[0]
    if (K % group or packed.shape[1] * 2 != K or packed.dtype != torch.uint8
            or scales_zeros.shape != (K // group, N, 2) or scales_zeros.stride(2) != 1):
        raise ValueError(f"int4 GEMM shapes: x {tuple(x.shape)}, packed {tuple(packed.shape)} {packed.dtype}, "
                         f"scales_zeros {tuple(scales_zeros.shape)}, group {group}")
    out = torch.empty(M, N, dtype=x.dtype, device=x.device)
    if M == 0 or N == 0:
        return out
    bm = block_m(M)
    _int4_mm_kernel[(triton.cdiv(M, bm), triton.cdiv(N, BLOCK_N))](
        x, packed, scales_zeros, scales_zeros if bias is None else bias, out, M, N, K,
        x.stride(0), x.stride(1), packed.stride(0), packed.stride(1), scales_zeros.stride(0),
        scales_zeros.stride(1), out.stride(0), out.stride(1),
        HAS_BIAS=bias is not None, O_ROUND=_ROUND[x.dtype],
        PRECISION="ieee" if x.dtype == torch.float32 else "tf32", WIDEN=INTERPRETED,
        BLOCK_M=bm, BLOCK_N=BLOCK_N, GROUP=group)
    return out
