"""The wire order of a batch's KV and the tensor views that feed it.

Both sides derive the same message list from the batch header alone, so sends and receives
pair up in order (HCCL ignores tags and cannot receive from any source):

    for layer in 0..L-1:
        for each request, in header order:
            for each run of consecutive decode-side block ids (a "chunk"):
                K[chunk], then V[chunk]

A chunk is contiguous in the receiver's cache, so D receives straight into its blocks; the
sender gathers its own blocks for a chunk (a view when they are consecutive, a copy otherwise).
Every message travels as raw bytes (uint8), so any KV dtype (bf16 included) crosses unchanged.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class Chunk:
    request_index: int  # position in BatchHeader.requests
    offset: int  # first block of the chunk, as an index into the request's block list
    num_blocks: int


def contiguous_runs(block_ids) -> list[tuple[int, int]]:
    """(offset, length) of each maximal run of consecutive increasing ids."""
    runs: list[tuple[int, int]] = []
    start = 0
    for i in range(1, len(block_ids) + 1):
        if i == len(block_ids) or block_ids[i] != block_ids[i - 1] + 1:
            runs.append((start, i - start))
            start = i
    return runs if block_ids else []


def layer_plan(dst_block_lists) -> list[Chunk]:
    """The chunks of one layer, in wire order (the same list for every layer)."""
    return [
        Chunk(r, off, n)
        for r, ids in enumerate(dst_block_lists)
        for off, n in contiguous_runs(list(ids))
    ]


def select_blocks(cache_tensor: torch.Tensor, block_ids) -> torch.Tensor:
    """Blocks `block_ids` of one layer's K or V: a view when consecutive, else a contiguous copy."""
    ids = list(block_ids)
    if ids and ids == list(range(ids[0], ids[0] + len(ids))):
        return cache_tensor[ids[0] : ids[0] + len(ids)]
    return cache_tensor.index_select(0, torch.as_tensor(ids, dtype=torch.long, device=cache_tensor.device))


def as_bytes(t: torch.Tensor) -> torch.Tensor:
    """A flat uint8 view of a contiguous tensor (shares its memory, so a recv writes through)."""
    if not t.is_contiguous():
        raise ValueError("KV transfer needs contiguous tensors")
    return t.reshape(-1).view(torch.uint8)
