"""Paged attention for packed batches, registered with transformers' AttentionInterface.

transformers' own layers (projections, M-RoPE, MLP) run unchanged; only the attention call is
ours: it writes the new K/V into the paged cache, then attends per prefill request (a fresh
prompt: causal SDPA over its own K/V; a later chunk: against its cached blocks) and for all
decode requests at once, through the engine's `PagedOps` (native csrc/ kernels or portable
torch; see ops/select.py). Ops with `attends_varlen` (torch_npu's kernels) attend every request
of the step in one call instead (`AttentionMeta.varlen`).
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
    meta, ops = epd_meta, epd_meta.ops
    layer = module.layer_idx
    scale = scaling if scaling is not None else query.shape[-1] ** -0.5
    q = query[0].transpose(0, 1)  # [T, H, d]
    k = key[0].transpose(0, 1)  # [T, KVH, d]
    v = value[0].transpose(0, 1)
    kc, vc = meta.kv_cache.keys[layer], meta.kv_cache.values[layer]
    ops.reshape_and_cache(k, v, kc, vc, meta.slots)
    if meta.varlen is not None:  # ops that attend the whole packed batch in one call (the NPU's)
        return ops.varlen_attention(q, kc, vc, meta.varlen, scale).unsqueeze(0), None
    out = None if meta.decode_only else torch.empty_like(q)
    for seg in meta.prefills:
        qs = slice(seg.q_start, seg.q_start + seg.q_len)
        if seg.ctx_len == seg.q_len:  # whole prompt in this step: fresh K/V, plain causal
            o = F.scaled_dot_product_attention(q[qs].transpose(0, 1).unsqueeze(0), k[qs].transpose(0, 1).unsqueeze(0),
                                               v[qs].transpose(0, 1).unsqueeze(0), is_causal=True, scale=scale,
                                               enable_gqa=True)
            out[qs] = o[0].transpose(0, 1)
        else:  # a later chunk: earlier tokens are read from the cache
            out[qs] = ops.prefill_attention(q[qs], kc, vc, seg.block_table, seg.ctx_len, scale)
    if meta.decode_token_idx.numel():
        qd = q if meta.decode_only else q[meta.decode_token_idx]  # [B, H, d]
        o = ops.decode_attention(qd, kc, vc, meta.decode_block_tables, meta.decode_ctx_lens, scale)
        if meta.decode_only:
            return o.unsqueeze(0), None  # [1, B, H, d] == [1, T, H, d]
        out.index_copy_(0, meta.decode_token_idx, o)
    return out.unsqueeze(0), None


def register() -> str:
    """Register the attention function with transformers (idempotent) and return its name."""
    from transformers import AttentionInterface

    AttentionInterface.register(ATTN_IMPL_NAME, paged_attention_forward)
    return ATTN_IMPL_NAME
