"""Deterministic KV contents and digests, to check a transfer bit for bit across processes.

Used by the transfer tests and the kv-transfer benchmark: both sides of a pair can fill or
hash the same blocks without sending tensors to each other.
"""
from __future__ import annotations

import hashlib

import torch


def fill_random(cache, layer: int, block_ids, seed: int) -> None:
    """Overwrite blocks `block_ids` of one layer's K and V with values drawn from `seed`."""
    spec = cache.spec
    gen = torch.Generator().manual_seed(seed * 1_000_003 + layer)
    shape = (len(block_ids), spec.block_size, spec.num_kv_heads, spec.head_dim)
    k = torch.randn(shape, generator=gen).to(spec.dtype)
    v = torch.randn(shape, generator=gen).to(spec.dtype)
    cache.write_blocks(layer, list(block_ids), k.to(cache.keys[layer].device), v.to(cache.values[layer].device))


def blocks_digest(cache, block_ids, num_tokens: int | None = None) -> str:
    """sha256 of every layer's K and V bytes of the given blocks (optionally only the first
    `num_tokens` token slots), in block order."""
    h = hashlib.sha256()
    for layer in range(cache.spec.num_layers):
        for t in cache.read_blocks(layer, list(block_ids)):
            t = t.flatten(0, 1)
            if num_tokens is not None:
                t = t[:num_tokens]
            h.update(t.contiguous().cpu().reshape(-1).view(torch.uint8).numpy().tobytes())
    return h.hexdigest()
