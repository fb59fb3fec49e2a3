"""Per-forward attention metadata for a packed, variable-length batch over a paged KV cache.

Built once per step by the model runner and handed to every layer's attention call as a
keyword argument (never stored on a module), so concurrent engines never share it.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from epdserve.ops.backend import PagedOps


@dataclass
class PrefillSegment:
    q_start: int  # offset of this request's tokens in the packed batch
    q_len: int
    ctx_len: int  # tokens in the cache for this request after this step (start + q_len)
    block_table: torch.Tensor  # [n_blocks] long


@dataclass
class AttentionMeta:
    kv_cache: object  # engine.kv_cache.PagedKVCache
    ops: PagedOps  # the paged operators this engine uses (ops/select.py)
    slots: torch.Tensor  # [T] flat slot of every packed token
    prefills: list[PrefillSegment]
    decode_token_idx: torch.Tensor  # [B] packed index of each decode token
    decode_block_tables: torch.Tensor  # [B, max_blocks] long (padded with 0)
    decode_ctx_lens: torch.Tensor  # [B] long
    decode_only: bool = False  # every packed token is a decode token, in order (no scatter needed)

    def __post_init__(self):
        n = self.decode_token_idx.numel()
        self.decode_only = bool(n) and not self.prefills and n == self.slots.numel()
