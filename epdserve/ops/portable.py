"""`PortableOps`: the paged operators in plain torch (any device) — gather the blocks, then SDPA.

The reference every other implementation is checked against, and the fallback where the native
operators cannot be built. Decode gathers every request's blocks into a padded contiguous copy
(index_select) and masks the padding; a later prefill chunk gathers its request's blocks.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from epdserve.ops.backend import PagedOps


class PortableOps(PagedOps):
    name = "portable"

    def reshape_and_cache(self, key, value, key_cache, value_cache, slots):
        kvh, d = key_cache.shape[2], key_cache.shape[3]
        key_cache.view(-1, kvh, d).index_copy_(0, slots, key)
        value_cache.view(-1, kvh, d).index_copy_(0, slots, value)

    def decode_attention(self, query, key_cache, value_cache, block_tables, ctx_lens, scale):
        B, nb = block_tables.shape
        if B == 0:
            return torch.empty_like(query)
        bs, kvh = key_cache.shape[1], key_cache.shape[2]
        span = (B, nb * bs, kvh, -1)
        flat = block_tables.reshape(-1)
        kc = key_cache.index_select(0, flat).view(span)  # index_select: faster than advanced indexing
        vc = value_cache.index_select(0, flat).view(span)
        keep = torch.arange(nb * bs, device=query.device)[None, :] < ctx_lens[:, None]
        # an additive float mask runs ~2x faster than a boolean one in CPU SDPA
        mask = torch.zeros(keep.shape, dtype=query.dtype, device=query.device).masked_fill_(~keep, float("-inf"))
        o = F.scaled_dot_product_attention(query.unsqueeze(2), kc.transpose(1, 2), vc.transpose(1, 2),
                                           attn_mask=mask[:, None, None, :], scale=scale, enable_gqa=True)
        return o[:, :, 0]

    def prefill_attention(self, query, key_cache, value_cache, block_table, ctx_len, scale):
        kc = key_cache.index_select(0, block_table).flatten(0, 1)[:ctx_len]
        vc = value_cache.index_select(0, block_table).flatten(0, 1)[:ctx_len]
        q_len = query.shape[0]
        qpos = torch.arange(ctx_len - q_len, ctx_len, device=query.device)
        mask = torch.arange(ctx_len, device=query.device)[None, :] <= qpos[:, None]
        o = F.scaled_dot_product_attention(query.transpose(0, 1).unsqueeze(0), kc.transpose(0, 1).unsqueeze(0),
                                           vc.transpose(0, 1).unsqueeze(0), attn_mask=mask, scale=scale,
                                           enable_gqa=True)
        return o[0].transpose(0, 1)
