"""Paged KV cache storage: per layer, one key and one value tensor of fixed-size blocks.

Layout (the contract shared with attention, the block manager and KV transfer):
    keys[layer], values[layer]: [num_blocks, block_size, num_kv_heads, head_dim]
A token at position p of a request lives in slot `block_table[p // block_size] * block_size +
p % block_size`. Which blocks belong to whom is the block manager's business, not this file's.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class KVCacheSpec:
    num_layers: int
    num_kv_heads: int
    head_dim: int
    block_size: int
    dtype: torch.dtype

    def bytes_per_block(self) -> int:
        elem = torch.empty((), dtype=self.dtype).element_size()
        return 2 * self.num_layers * self.block_size * self.num_kv_heads * self.head_dim * elem

    def blocks_for_budget(self, budget_bytes: int) -> int:
        """How many blocks fit in `budget_bytes` (at least 1 is required)."""
        n = budget_bytes // self.bytes_per_block()
        if n < 1:
            raise ValueError(
                f"KV memory budget {budget_bytes} B is smaller than one block ({self.bytes_per_block()} B)"
            )
        return int(n)


class PagedKVCache:
    """Owns the block tensors; reads and writes token slots and whole blocks.

    Blocks 0 .. num_blocks-1 are the block manager's; one more, `pad_block`, is never handed
    out: the padding rows of a captured decode graph write and read it (engine/graph_runner.py)."""

    def __init__(self, spec: KVCacheSpec, num_blocks: int, device: torch.device | str = "cpu"):
        self.spec = spec
        self.num_blocks = num_blocks
        self.pad_block = num_blocks
        shape = (num_blocks + 1, spec.block_size, spec.num_kv_heads, spec.head_dim)
        self.keys = [torch.zeros(shape, dtype=spec.dtype, device=device) for _ in range(spec.num_layers)]
        self.values = [torch.zeros(shape, dtype=spec.dtype, device=device) for _ in range(spec.num_layers)]

    def write(self, layer: int, slots: torch.Tensor, key: torch.Tensor, value: torch.Tensor) -> None:
        """Store key/value [T, kv_heads, head_dim] at flat slot indices `slots` [T]."""
        kv_shape = (-1, self.spec.num_kv_heads, self.spec.head_dim)
        self.keys[layer].view(kv_shape).index_copy_(0, slots, key)
        self.values[layer].view(kv_shape).index_copy_(0, slots, value)

    def gather(self, layer: int, block_ids: list[int] | torch.Tensor, num_tokens: int):
        """Contiguous (key, value) [num_tokens, kv_heads, head_dim] of one request."""
        idx = torch.as_tensor(block_ids, dtype=torch.long, device=self.keys[layer].device)
        k = self.keys[layer].index_select(0, idx).flatten(0, 1)[:num_tokens]
        v = self.values[layer].index_select(0, idx).flatten(0, 1)[:num_tokens]
        return k, v

    def write_blocks(self, layer: int, block_ids: list[int], key: torch.Tensor, value: torch.Tensor) -> None:
        """Fill whole blocks from key/value [len(block_ids), block_size, kv_heads, head_dim]."""
        idx = torch.as_tensor(block_ids, dtype=torch.long, device=self.keys[layer].device)
        self.keys[layer].index_copy_(0, idx, key)
        self.values[layer].index_copy_(0, idx, value)

    def copy_blocks(self, pairs: list[tuple[int, int]]) -> None:
        """Copy whole blocks src → dst (every layer, keys and values), on the device."""
        if not pairs:
            return
        dev = self.keys[0].device
        src = torch.tensor([a for a, _ in pairs], dtype=torch.long, device=dev)
        dst = torch.tensor([b for _, b in pairs], dtype=torch.long, device=dev)
        for cache in (*self.keys, *self.values):
            cache.index_copy_(0, dst, cache.index_select(0, src))

    def read_blocks(self, layer: int, block_ids: list[int]):
        """Whole blocks (key, value) [len(block_ids), block_size, kv_heads, head_dim] (copies)."""
        idx = torch.as_tensor(block_ids, dtype=torch.long, device=self.keys[layer].device)
        return self.keys[layer].index_select(0, idx), self.values[layer].index_select(0, idx)
