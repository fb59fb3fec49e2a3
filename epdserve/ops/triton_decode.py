"""Paged decode attention as one Triton kernel: each request's one query token against its cached
K/V read straight from the block table — no gather of the context into a padded copy, no mask
tensor (the portable path, ops/portable.py, builds both every step and layer).

`paged_decode_attention(query, key_cache, value_cache, block_tables, ctx_lens, scale)` has
`PagedOps.decode_attention`'s contract (ops/backend.py): query [B, heads, head_dim], caches
[blocks, block_size, kv_heads, head_dim], block_tables [B, max_blocks], ctx_lens [B] (device
tensors: nothing is read on the host, so a captured decode graph replays it with each step's
lengths). One program per (request, query head); GQA by heads // kv_heads; the context is walked
one KV block at a time with an online softmax in fp32 (running max and sum), the output written in
the query's dtype. A row with no context (ctx_len 0) gets zeros. head_dim need not be a power of
two (the lanes past it are masked); block_size must be one (16 on CUDA, the platform's default).

Runs wherever Triton runs: CUDA, and this CPU through Triton's interpreter (`TRITON_INTERPRET=1`,
read when the kernel is decorated, so set before this module is imported), which is how
tests/ops/test_triton_decode.py checks it against the portable op. Imported only when used
(`ops/triton_ops.py`).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _paged_decode_kernel(q_ptr, k_ptr, v_ptr, bt_ptr, ctx_ptr, o_ptr, scale,
                         stride_qb, stride_qh, stride_kn, stride_kt, stride_kh, stride_bt, stride_ob, stride_oh,
                         GROUP: tl.constexpr, BLOCK_SIZE: tl.constexpr, HEAD_DIM: tl.constexpr,
                         BLOCK_D: tl.constexpr):
    b = tl.program_id(0)
    h = tl.program_id(1)
    kvh = h // GROUP
    offs_d = tl.arange(0, BLOCK_D)
    d_ok = offs_d < HEAD_DIM
    offs_t = tl.arange(0, BLOCK_SIZE)
    q = tl.load(q_ptr + b * stride_qb + h * stride_qh + offs_d, mask=d_ok, other=0.0).to(tl.float32)
    ctx = tl.load(ctx_ptr + b)
    m_i = tl.max(tl.full([BLOCK_SIZE], float("-inf"), tl.float32), axis=0)
    l_i = tl.sum(tl.zeros([BLOCK_SIZE], tl.float32), axis=0)
    acc = tl.zeros([BLOCK_D], tl.float32)
    for i in range(0, tl.cdiv(ctx, BLOCK_SIZE)):
        block = tl.load(bt_ptr + b * stride_bt + i)
        t_ok = i * BLOCK_SIZE + offs_t < ctx
        offs = block * stride_kn + offs_t[:, None] * stride_kt + kvh * stride_kh + offs_d[None, :]
        ok = t_ok[:, None] & d_ok[None, :]
        k = tl.load(k_ptr + offs, mask=ok, other=0.0).to(tl.float32)
        s = tl.where(t_ok, tl.sum(k * q[None, :], axis=1) * scale, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, axis=0))
        alpha = tl.exp(m_i - m_new)
        p = tl.exp(s - m_new)
        v = tl.load(v_ptr + offs, mask=ok, other=0.0).to(tl.float32)
        acc = acc * alpha + tl.sum(p[:, None] * v, axis=0)
        l_i = l_i * alpha + tl.sum(p, axis=0)
        m_i = m_new
    out = tl.where(l_i > 0, acc / tl.maximum(l_i, 1e-30), 0.0)
    tl.store(o_ptr + b * stride_ob + h * stride_oh + offs_d, out.to(o_ptr.dtype.element_ty), mask=d_ok)


def paged_decode_attention(query: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
                           block_tables: torch.Tensor, ctx_lens: torch.Tensor, scale: float) -> torch.Tensor:
    """[B, heads, head_dim]: see the module docstring."""
    B, H, D = query.shape
    out = torch.empty_like(query)
    if B == 0:
        return out
    _, bs, kvh, _ = key_cache.shape
    if bs & (bs - 1):
        raise ValueError(f"the Triton decode kernel needs a power-of-two block size, got {bs}")
    if key_cache.stride() != value_cache.stride() or key_cache.stride(-1) != 1 or query.stride(-1) != 1:
        raise ValueError("the Triton decode kernel needs K and V caches of one layout, head_dim contiguous")
    _paged_decode_kernel[(B, H)](
        query, key_cache, value_cache, block_tables, ctx_lens, out, scale,
        query.stride(0), query.stride(1), key_cache.stride(0), key_cache.stride(1), key_cache.stride(2),
        block_tables.stride(0), out.stride(0), out.stride(1),
        GROUP=H // kvh, BLOCK_SIZE=bs, HEAD_DIM=D, BLOCK_D=triton.next_power_of_2(D))
    return out
