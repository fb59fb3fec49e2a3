"""The W8A16 GEMM as one Triton kernel: activations x [M, K] (fp32, bf16 or fp16) times int8
weights q [N, K] dequantized in the kernel by one scale per output channel, accumulated in fp32,
output in x's dtype, a bias added — what `Int8Linear` (engine/lm/quant_linear.py) computes, on CUDA
(engine/lm/cuda_quant_linear.py holds the weights and checks this kernel at start-up).

Why Triton and not torch's own op: torch registers a CUDA kernel for `_weight_int8pack_mm`
(native_functions.yaml: `CUDA: _weight_int8pack_mm_cuda`, added by pytorch/pytorch PR #159325,
merged by September 2025 — PR #163461 unskips its Inductor test "as the kernel was added by
#159325" — so before the 2.10 and 2.11 releases; the dispatch line was read in the
native_functions.yaml of the torch 2.13 installed here, not at the v2.11.0 tag of the GPU image),
but that kernel (aten/src/ATen/native/cuda/int8mm.cu, pytorch main) is
one thread per output element walking all of K in a scalar loop, with x copied to fp32 and the
output copied back to x's dtype on every call: no tiling, no tensor cores, three extra passes over
the activations. This kernel tiles M × N × K and feeds `tl.dot` (tensor cores for bf16 / fp16).

Layout: q is read as the CPU class holds it, [N, K] row-major (the checkpoint's [out, in], no
copy; a checkpoint's own int8 weights arrive so too). A [BLOCK_K, BLOCK_N] tile of it is BLOCK_N
runs of BLOCK_K contiguous bytes — K is the contiguous axis of both x and q, so every load of the
K loop is coalesced along K, and at decode (M of a few rows, memory-bound) each output channel's
weights are one contiguous stream. The strides are passed, so a [K, N] view works too (slower).

Arithmetic, matched to `Int8Linear`'s packed path (`torch._weight_int8pack_mm` then `add_(bias)`):
each int8 weight is converted to x's dtype (exact: |q| <= 127), the products summed in fp32 (exact
products for bf16 / fp16; fp32 operands go through `tl.dot` at "ieee" precision, never TF32), the
sum multiplied by the channel's scale in fp32 and rounded once to x's dtype; a bias is then added in
fp32 and rounded to x's dtype again — the CPU class's two roundings at the same two points. Only
the summation order differs (fp32). Rounding to bf16 is done on the fp32 bits (ops/triton_layer.py
`_round`: Triton's interpreter truncates on a bf16 cast; the GPU rounds). The interpreter's `tl.dot`
also misreads bf16 operands (numpy has no bf16), so interpreted, both operands are widened to fp32
first — the same exact products, the same fp32 sums; the GPU feeds bf16 / fp16 to the tensor cores. Bound against the
dequantized float product p = x · (q · scale)ᵀ (fp32), with u the dtype's unit roundoff (2^-8 bf16,
2^-11 fp16, 2^-24 fp32), S = |x| · (|q| · scale)ᵀ and b the bias:
    |out - (p + b)| <= K · 2^-24 · S  +  u · |p|  +  u · |p + b|   (to first order; tests add 2^-24 · S slack)

No host reads: M, N, K and the strides are shapes (host ints); the grid and block sizes follow from
them alone, so a captured decode graph replays one launch per batch size. Runs wherever Triton
runs: CUDA, and this CPU through Triton's interpreter (`TRITON_INTERPRET=1` before triton is
imported), which is how tests/ops/test_cuda_quant_linear.py checks it. Imported only when used.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from epdserve.ops.triton_layer import _ROUND, INTERPRETED, _round

DTYPES = tuple(_ROUND)  # the activation dtypes the kernel takes
BLOCK_N, BLOCK_K = 64, 64  # untuned: no GPU measured this kernel yet


@triton.jit
def _int8_mm_kernel(x_ptr, q_ptr, s_ptr, b_ptr, o_ptr, M, N, K,
                    sxm, sxk, sqn, sqk, som, son,
                    HAS_BIAS: tl.constexpr, O_ROUND: tl.constexpr, PRECISION: tl.constexpr, WIDEN: tl.constexpr,
                    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    m_ok = offs_m < M
    n_ok = offs_n < N
    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    for k0 in range(0, K, BLOCK_K):
        k_ok = k0 + offs_k < K
        x = tl.load(x_ptr + offs_m[:, None] * sxm + (k0 + offs_k)[None, :] * sxk,
                    mask=m_ok[:, None] & k_ok[None, :], other=0.0)
        q = tl.load(q_ptr + offs_n[None, :] * sqn + (k0 + offs_k)[:, None] * sqk,
                    mask=k_ok[:, None] & n_ok[None, :], other=0)  # [BLOCK_K, BLOCK_N]
        if WIDEN:  # the interpreter's bf16 dot is wrong; fp32 operands give the same exact products
            acc = tl.dot(x.to(tl.float32), q.to(tl.float32), acc, input_precision="ieee")
        else:
            acc = tl.dot(x, q.to(x.dtype), acc, input_precision=PRECISION)
    scale = tl.load(s_ptr + offs_n, mask=n_ok, other=0.0).to(tl.float32)
    y = _round(acc * scale[None, :], O_ROUND)
    if HAS_BIAS:
        bias = tl.load(b_ptr + offs_n, mask=n_ok, other=0.0).to(tl.float32)
        y = _round(y + bias[None, :], O_ROUND)
    tl.store(o_ptr + offs_m[:, None] * som + offs_n[None, :] * son, y.to(o_ptr.dtype.element_ty),
             mask=m_ok[:, None] & n_ok[None, :])


def block_m(rows: int) -> int:
    """The rows one program covers: 16 (tl.dot's least) up to 16 rows (decode), then 32, then 64."""
    return 16 if rows <= 16 else 32 if rows <= 32 else 64


def int8_weight_mm(x: torch.Tensor, q: torch.Tensor, scales: torch.Tensor,
                   bias: torch.Tensor | None = None) -> torch.Tensor:
    """[M, N] in x's dtype: x [M, K] times q [N, K] int8 (any strides) dequantized by `scales` [N],
    plus `bias` [N] (module docstring)."""
    if x.dtype not in DTYPES:
        raise ValueError(f"the int8 Triton GEMM takes fp32, bf16 or fp16 activations, not {x.dtype}")
    M, K = x.shape
    N = q.shape[0]
    if q.shape[1] != K or q.dtype != torch.int8 or scales.shape != (N,):
        raise ValueError(f"int8 GEMM shapes: x {tuple(x.shape)}, q {tuple(q.shape)} {q.dtype}, scales "
                         f"{tuple(scales.shape)}")
    out = torch.empty(M, N, dtype=x.dtype, device=x.device)
    if M == 0 or N == 0:
        return out
    bm = block_m(M)
    _int8_mm_kernel[(triton.cdiv(M, bm), triton.cdiv(N, BLOCK_N))](
        x, q, scales, scales if bias is None else bias, out, M, N, K,
        x.stride(0), x.stride(1), q.stride(0), q.stride(1), out.stride(0), out.stride(1),
        HAS_BIAS=bias is not None, O_ROUND=_ROUND[x.dtype],
        PRECISION="ieee" if x.dtype == torch.float32 else "tf32", WIDEN=INTERPRETED,
        BLOCK_M=bm, BLOCK_N=BLOCK_N, BLOCK_K=BLOCK_K)
    return out
