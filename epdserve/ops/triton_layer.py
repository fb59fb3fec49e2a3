"""An LM layer's fused element-wise operators and the paged KV write as Triton kernels, one launch
each: add + RMSNorm (the sum and the norm), RMSNorm, rotary (q and k together, in place),
SiLU-and-mul, and K and V written at their slots.

The arithmetic is `PortableLayerOps`' (ops/layer_ops.py) op for op: every value is widened to
fp32, each torch operation on the model's dtype is one fp32 operation rounded to that dtype at the
same point (`residual + x`; `h.to(dtype)` then `weight * h`; `q * cos`, `rotate_half(q) * sin` and
their sum; `silu(gate)` then `* up`), so the outputs equal the portable ones bit for bit — but for
RMSNorm's fp32 sum of squares, whose order differs (and, in the interpreter, `exp`: see below).
Rounding to bfloat16 is done on the fp32 bits (round to nearest even), not by a cast: Triton's
interpreter truncates on a bf16 cast, the GPU rounds; the bit form is exact on both. fp32 mul-adds
are not fused (`enable_fp_fusion=False`), as torch's separate operators do not fuse them.
SiLU's exp is libdevice's `exp` on the GPU (CUDA's `expf`, what torch's kernel calls) and its
division correctly rounded (`div_rn`, CUDA's `/`); the interpreter has no libdevice and uses
numpy's exp, which differs from torch's CPU exp in the last fp32 bit for a few inputs.

Shapes: rows of any length (the lanes past it masked), rows and tokens strided (their strides are
passed; the last dim must be contiguous, else it is copied once). Runs wherever Triton runs: CUDA,
and this CPU through Triton's interpreter (`TRITON_INTERPRET=1`, read at import), which is how
tests/ops/test_triton_layer.py checks the kernels against the portable ops. Imported only when
chosen (ops/triton_layer_ops.py, ops/triton_ops.py).
"""
from __future__ import annotations

import os

import torch
import triton
import triton.language as tl
from triton.language.extra import libdevice

INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"  # read once, as Triton reads it: no libdevice then
_ROUND = {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2}  # how a value of the dtype is rounded
DTYPES = tuple(_ROUND)


@triton.jit
def _round(x, MODE: tl.constexpr):
    """fp32 `x` rounded to the dtype MODE names (0 fp32, 1 bf16, 2 fp16), returned as fp32."""
    if MODE == 1:  # round to nearest even on the bits; NaN kept
        b = x.to(tl.uint32, bitcast=True)
        b = (b + 0x7FFF + ((b >> 16) & 1)) & 0xFFFF0000
        return tl.where(x != x, x, b.to(tl.float32, bitcast=True))
    elif MODE == 2:
        return x.to(tl.float16).to(tl.float32)
    else:
        return x


@triton.jit
def _exp(x, PRECISE: tl.constexpr):
    if PRECISE:
        return libdevice.exp(x)
    else:
        return tl.exp(x)


@triton.jit
def _norm_kernel(x_ptr, r_ptr, w_ptr, o_ptr, s_ptr, eps, N, INNER,
                 sx0, sx1, sr0, sr1, so0, so1, ss0, ss1,
                 HAS_RES: tl.constexpr, X_ROUND: tl.constexpr, O_ROUND: tl.constexpr, BLOCK: tl.constexpr):
    """One row per program; a row is (pid // INNER, pid % INNER) of a [rows, INNER, N] view."""
    pid = tl.program_id(0)
    i = pid // INNER
    j = pid % INNER
    offs = tl.arange(0, BLOCK)
    ok = offs < N
    x = tl.load(x_ptr + i * sx0 + j * sx1 + offs, mask=ok, other=0.0).to(tl.float32)
    if HAS_RES:
        r = tl.load(r_ptr + i * sr0 + j * sr1 + offs, mask=ok, other=0.0).to(tl.float32)
        x = _round(r + x, X_ROUND)
        tl.store(s_ptr + i * ss0 + j * ss1 + offs, x.to(s_ptr.dtype.element_ty), mask=ok)
    var = tl.math.div_rn(tl.sum(x * x, axis=0), N * 1.0)
    h = _round(x * tl.rsqrt(var + eps), X_ROUND)
    w = tl.load(w_ptr + offs, mask=ok, other=0.0).to(tl.float32)
    y = _round(w * h, O_ROUND)
    tl.store(o_ptr + i * so0 + j * so1 + offs, y.to(o_ptr.dtype.element_ty), mask=ok)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None):
    """`weight * rms_normalized(residual + x)` in one launch → (normed, summed); summed is `x` when
    `residual` is None. x, residual [..., N] of one dtype (x's last two dims may be strided views),
    weight [N]; normed has `weight * x`'s dtype, both are new tensors."""
    N = x.shape[-1]
    x3 = _rows3(x)
    out = torch.empty(x.shape, dtype=torch.promote_types(weight.dtype, x.dtype), device=x.device)
    o3 = out.view(x3.shape)
    if residual is None:
        r3 = s3 = x3  # unread, unwritten (HAS_RES=False)
        summed = x
    else:
        r3 = _rows3(residual)
        summed = torch.empty(x.shape, dtype=x.dtype, device=x.device)
        s3 = summed.view(x3.shape)
    rows = x3.shape[0] * x3.shape[1]
    if rows == 0:
        return out, summed
    block = triton.next_power_of_2(N)
    _norm_kernel[(rows,)](x3, r3, weight, o3, s3, float(eps), N, x3.shape[1],
                          x3.stride(0), x3.stride(1), r3.stride(0), r3.stride(1), o3.stride(0), o3.stride(1),
                          s3.stride(0), s3.stride(1), HAS_RES=residual is not None, X_ROUND=_ROUND[x.dtype],
                          O_ROUND=_ROUND[out.dtype], BLOCK=block, num_warps=_warps(block), enable_fp_fusion=False)
    return out, summed


@triton.jit
def _rotate(ptr, st, sh, t, heads, c1, c2, s1, s2, offs_h, offs_d, HALF: tl.constexpr,
            MODE: tl.constexpr):
    """Token t's `heads` heads at ptr (strides st, sh): x * cos + rotate_half(x) * sin, in place."""
    ok = (offs_h[:, None] < heads) & (offs_d[None, :] < HALF)
    p1 = ptr + t * st + offs_h[:, None] * sh + offs_d[None, :]
    x1 = tl.load(p1, mask=ok, other=0.0).to(tl.float32)
    x2 = tl.load(p1 + HALF, mask=ok, other=0.0).to(tl.float32)
    y1 = _round(_round(x1 * c1, MODE) + _round(-x2 * s1, MODE), MODE)
    y2 = _round(_round(x2 * c2, MODE) + _round(x1 * s2, MODE), MODE)
    tl.store(p1, y1.to(ptr.dtype.element_ty), mask=ok)
    tl.store(p1 + HALF, y2.to(ptr.dtype.element_ty), mask=ok)


@triton.jit
def _rotary_kernel(q_ptr, k_ptr, cos_ptr, sin_ptr, H, KVH, sqt, sqh, skt, skh, sct, sst,
                   HALF: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_KVH: tl.constexpr,
                   MODE: tl.constexpr):
    """One program per token: its q heads and k heads, both halves of each."""
    t = tl.program_id(0)
    offs_d = tl.arange(0, BLOCK_D)
    d_ok = offs_d < HALF
    c1 = tl.load(cos_ptr + t * sct + offs_d, mask=d_ok, other=0.0).to(tl.float32)[None, :]
    c2 = tl.load(cos_ptr + t * sct + HALF + offs_d, mask=d_ok, other=0.0).to(tl.float32)[None, :]
    s1 = tl.load(sin_ptr + t * sst + offs_d, mask=d_ok, other=0.0).to(tl.float32)[None, :]
    s2 = tl.load(sin_ptr + t * sst + HALF + offs_d, mask=d_ok, other=0.0).to(tl.float32)[None, :]
    _rotate(q_ptr, sqt, sqh, t, H, c1, c2, s1, s2, tl.arange(0, BLOCK_H), offs_d, HALF, MODE)
    _rotate(k_ptr, skt, skh, t, KVH, c1, c2, s1, s2, tl.arange(0, BLOCK_KVH), offs_d, HALF, MODE)


def rotary(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> None:
    """Rotate q [T, H, d] and k [T, KVH, d] in place (token dims may be strided; heads and d
    contiguous within a token); cos / sin [T, d] of q's dtype, d even."""
    T, H, d = q.shape
    if T == 0:
        return
    half = d // 2
    bd = triton.next_power_of_2(half)
    _rotary_kernel[(T,)](q, k, cos, sin, H, k.shape[1], q.stride(0), q.stride(1), k.stride(0), k.stride(1),
                         cos.stride(0), sin.stride(0), HALF=half, BLOCK_D=bd, BLOCK_H=triton.next_power_of_2(H),
                         BLOCK_KVH=triton.next_power_of_2(k.shape[1]), MODE=_ROUND[q.dtype],
                         num_warps=_warps(bd * triton.next_power_of_2(H)), enable_fp_fusion=False)


@triton.jit
def _silu_mul_kernel(x_ptr, o_ptr, I, sx, so, MODE: tl.constexpr, PRECISE: tl.constexpr, BLOCK: tl.constexpr):
    """Program (row, chunk): silu(gate) rounded, times up, rounded."""
    t = tl.program_id(0)
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    ok = offs < I
    g = tl.load(x_ptr + t * sx + offs, mask=ok, other=0.0).to(tl.float32)
    u = tl.load(x_ptr + t * sx + I + offs, mask=ok, other=0.0).to(tl.float32)
    s = _round(tl.math.div_rn(g, 1.0 + _exp(-g, PRECISE)), MODE)
    tl.store(o_ptr + t * so + offs, _round(s * u, MODE).to(o_ptr.dtype.element_ty), mask=ok)


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """x [T, 2I] (rows may be strided) → silu(x[:, :I]) * x[:, I:] [T, I], new."""
    T, two_i = x.shape
    inter = two_i // 2
    out = torch.empty((T, inter), dtype=x.dtype, device=x.device)
    if T == 0 or inter == 0:
        return out
    block = min(1024, triton.next_power_of_2(inter))
    _silu_mul_kernel[(T, triton.cdiv(inter, block))](x, out, inter, x.stride(0), out.stride(0), MODE=_ROUND[x.dtype],
                                                     PRECISE=not INTERPRETED, BLOCK=block,
                                                     num_warps=_warps(block), enable_fp_fusion=False)
    return out


@triton.jit
def _kv_write_kernel(k_ptr, v_ptr, kc_ptr, vc_ptr, slot_ptr, KVH, D, BS,
                     skt, skh, svt, svh, sc0, sc1, sc2, vc0, vc1, vc2,
                     BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr):
    """One program per token: its K and V [KVH, D] written at its slot (a negative slot: nothing)."""
    t = tl.program_id(0)
    slot = tl.load(slot_ptr + t).to(tl.int64)
    offs_h = tl.arange(0, BLOCK_H)[:, None]
    offs_d = tl.arange(0, BLOCK_D)[None, :]
    ok = (offs_h < KVH) & (offs_d < D) & (offs_d * 0 + slot >= 0)  # (a tensor: the interpreter's masks)
    block = slot // BS
    pos = slot % BS
    key = tl.load(k_ptr + t * skt + offs_h * skh + offs_d, mask=ok)
    val = tl.load(v_ptr + t * svt + offs_h * svh + offs_d, mask=ok)
    tl.store(kc_ptr + block * sc0 + pos * sc1 + offs_h * sc2 + offs_d, key.to(kc_ptr.dtype.element_ty), mask=ok)
    tl.store(vc_ptr + block * vc0 + pos * vc1 + offs_h * vc2 + offs_d, val.to(vc_ptr.dtype.element_ty), mask=ok)


def reshape_and_cache(key: torch.Tensor, value: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
                      slots: torch.Tensor) -> None:
    """key / value [T, KVH, D] (token dims may be strided) into the caches [blocks, block_size, KVH, D]
    at flat `slots` [T], in one launch."""
    T = key.shape[0]
    if T == 0:
        return
    _, bs, kvh, d = key_cache.shape
    key, value = (t if t.stride(-1) == 1 else t.contiguous() for t in (key, value))
    if key_cache.stride(-1) != 1 or value_cache.stride(-1) != 1:
        raise ValueError("the Triton KV write needs caches with head_dim contiguous")
    bh, bd = triton.next_power_of_2(kvh), triton.next_power_of_2(d)
    _kv_write_kernel[(T,)](key, value, key_cache, value_cache, slots, kvh, d, bs,
                           key.stride(0), key.stride(1), value.stride(0), value.stride(1),
                           key_cache.stride(0), key_cache.stride(1), key_cache.stride(2),
                           value_cache.stride(0), value_cache.stride(1), value_cache.stride(2),
                           BLOCK_H=bh, BLOCK_D=bd, num_warps=_warps(bh * bd))


def _rows3(x: torch.Tensor) -> torch.Tensor:
    """x [..., N] as a [rows, inner, N] view (a copy only where no such view exists), N contiguous."""
    if x.stride(-1) != 1:
        x = x.contiguous()
    if x.dim() == 1:
        return x.view(1, 1, -1)
    if x.dim() == 2:
        return x.unsqueeze(1)
    if x.dim() == 3:
        return x
    return x.reshape(-1, x.shape[-2], x.shape[-1])


def _warps(lanes: int) -> int:
    return max(1, min(16, lanes // 256))
