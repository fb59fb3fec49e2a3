"""Paged attention for packed batches, registered with transformers' AttentionInterface.

transformers' own layers (projections, M-RoPE, MLP) run unchanged; only the attention call is
ours: it writes the new K/V into the paged cache, then attends per prefill request (causal,
with earlier chunks read back from the cache) and for all decode requests at once (block
tables gathered, padded, masked). This is the portable (CPU/CUDA) implementation; an NPU one
would call torch_npu's paged-attention kernels behind the same signature.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from epdserve.ops.attention_meta import AttentionMeta

ATTN_IMPL_NAME = "epdserve_paged"


def paged_attention_forward(module, query, key, value, attention_mask, scaling=None, epd_meta: AttentionMeta = None, **kwargs):
    """query [1, H, T, d], key/value [1, KVH, T, d] (RoPE applied) → ([1, T, H, d], None)."""
    if epd_meta is None:
        raise RuntimeError(f"{ATTN_IMPL_NAME} attention called without epd_meta (only the epdserve runner may use it)")
    meta = epd_meta
    layer = module.layer_idx
    q = query[0].transpose(0, 1)  # [T, H, d]
    k = key[0].transpose(0, 1)  # [T, KVH, d]
    v = value[0].transpose(0, 1)
    cache = meta.kv_cache
    cache.write(layer, meta.slots, k, v)
    out = None if meta.decode_only else torch.empty_like(q)
    for seg in meta.prefills:
        qs = slice(seg.q_start, seg.q_start + seg.q_len)
        qh = q[qs].transpose(0, 1).unsqueeze(0)  # [1, H, q, d]
        if seg.ctx_len == seg.q_len:  # whole prompt in this step: fresh K/V, plain causal
            kh = k[qs].transpose(0, 1).unsqueeze(0)
            vh = v[qs].transpose(0, 1).unsqueeze(0)
            o = F.scaled_dot_product_attention(qh, kh, vh, is_causal=True, scale=scaling, enable_gqa=True)
        else:  # a later chunk: earlier tokens come from the cache
            kc, vc = cache.gather(layer, seg.block_table, seg.ctx_len)
            kh, vh = kc.transpose(0, 1).unsqueeze(0), vc.transpose(0, 1).unsqueeze(0)
            first = seg.ctx_len - seg.q_len
            qpos = torch.arange(first, seg.ctx_len, device=q.device)
            mask = torch.arange(seg.ctx_len, device=q.device)[None, :] <= qpos[:, None]
            o = F.scaled_dot_product_attention(qh, kh, vh, attn_mask=mask, scale=scaling, enable_gqa=True)
        out[qs] = o[0].transpose(0, 1)
    if meta.decode_token_idx.numel():
        bt = meta.decode_block_tables  # [B, nb]
        B, nb = bt.shape
        span = (B, nb * cache.spec.block_size, cache.spec.num_kv_heads, -1)
        flat = bt.reshape(-1)
        kc = cache.keys[layer].index_select(0, flat).view(span)  # index_select: faster than advanced indexing
        vc = cache.values[layer].index_select(0, flat).view(span)
        qd = q.unsqueeze(2) if meta.decode_only else q[meta.decode_token_idx].unsqueeze(2)  # [B, H, 1, d]
        o = F.scaled_dot_product_attention(
            qd, kc.transpose(1, 2), vc.transpose(1, 2), attn_mask=meta.decode_mask, scale=scaling, enable_gqa=True
        )
        if meta.decode_only:
            return o.transpose(1, 2), None  # [B, 1, H, d] == [1, T, H, d] reshaped by the caller
        out.index_copy_(0, meta.decode_token_idx, o[:, :, 0])
    return out.unsqueeze(0), None


def register() -> str:
    """Register the attention function with transformers (idempotent) and return its name."""
    from transformers import AttentionInterface

    AttentionInterface.register(ATTN_IMPL_NAME, paged_attention_forward)
    return ATTN_IMPL_NAME
