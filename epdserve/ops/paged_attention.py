"""Paged attention of one layer over a packed, variable-length batch (the lean LM calls it).

`paged_attend` writes the layer's new K/V into the paged cache, then attends per prefill request
(a fresh prompt: causal SDPA over its own K/V; a later chunk: against its cached blocks) and for
all decode requests at once, through the engine's `PagedOps` (native csrc/ kernels or portable
torch; see ops/select.py). Ops with `attends_varlen` (torch_npu's kernels) attend every request
of the step in one call instead (`AttentionMeta.varlen`). A decode-only step (the common case,
and the one graph capture replays) makes exactly two operator calls: the cache write and the
decode attention.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from epdserve.ops.attention_meta import AttentionMeta


def paged_attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer: int, meta: AttentionMeta,
                 scale: float) -> torch.Tensor:
    """q [T, H, d], k / v [T, KVH, d] (RoPE applied) → [T, H, d]."""
    ops = meta.ops
    kc, vc = meta.kv_cache.keys[layer], meta.kv_cache.values[layer]
    ops.reshape_and_cache(k, v, kc, vc, meta.slots)
    if meta.varlen is not None:  # ops that attend the whole packed batch in one call (the NPU's)
        return ops.varlen_attention(q, kc, vc, meta.varlen, scale)
    if meta.decode_only:
        return ops.decode_attention(q, kc, vc, meta.decode_block_tables, meta.decode_ctx_lens, scale)
    out = torch.empty_like(q)
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
        o = ops.decode_attention(q[meta.decode_token_idx], kc, vc, meta.decode_block_tables, meta.decode_ctx_lens,
                                 scale)
        out.index_copy_(0, meta.decode_token_idx, o)
    return out
