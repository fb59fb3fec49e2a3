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
    """One instance per engine (it memoizes the step's decode mask; not for sharing across threads)."""

    name = "portable"

    def __init__(self):
        self._mask_for: tuple | None = None  # (ctx_lens, width) the mask below was built for
        self._mask: torch.Tensor | None = None

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
        o = F.scaled_dot_product_attention(query.unsqueeze(2), kc.transpose(1, 2), vc.transpose(1, 2),
                                           attn_mask=self._decode_mask(ctx_lens, nb * bs, query), scale=scale,
                                           enable_gqa=True)
        return o[:, :, 0]

    def _decode_mask(self, ctx_lens: torch.Tensor, width: int, query: torch.Tensor) -> torch.Tensor:
        """[B, 1, 1, width] additive mask (0 / -inf) of the padding; built once per step: every
        layer of a step passes the same `ctx_lens` tensor."""
        m = self._mask_for
        if m is None or m[0] is not ctx_lens or m[1] != width or self._mask.dtype != query.dtype:
            keep = torch.arange(width, device=query.device)[None, :] < ctx_lens[:, None]
            # additive float mask, not a boolean one: CPU SDPA runs it faster (docs/measurements.md)
            mask = torch.zeros(keep.shape, dtype=query.dtype, device=query.device).masked_fill_(~keep, float("-inf"))
            self._mask_for, self._mask = (ctx_lens, width), mask[:, None, None, :]
        return self._mask

    def prefill_attention(self, query, key_cache, value_cache, block_table, ctx_len, scale):
        return prefill_attention(query, key_cache, value_cache, block_table, ctx_len, scale)


def prefill_attention(query, key_cache, value_cache, block_table, ctx_len, scale):
    """A later chunk: gather its request's blocks once, then causal SDPA (stateless; NativeOps
    uses it for long chunks too)."""
    kc = key_cache.index_select(0, block_table).flatten(0, 1)[:ctx_len]
    vc = value_cache.index_select(0, block_table).flatten(0, 1)[:ctx_len]
    q_len = query.shape[0]
    qpos = torch.arange(ctx_len - q_len, ctx_len, device=query.device)
    mask = torch.arange(ctx_len, device=query.device)[None, :] <= qpos[:, None]
    o = F.scaled_dot_product_attention(query.transpose(0, 1).unsqueeze(0), kc.transpose(0, 1).unsqueeze(0),
                                       vc.transpose(0, 1).unsqueeze(0), attn_mask=mask, scale=scale,
                                       enable_gqa=True)
    return o[0].transpose(0, 1)
