"""`ByteLRU`: the one least-recently-used map of lists of tensors bounded by their bytes.

Both feature caches keep their entries in one: the in-process `LocalFeatureProvider` and the
MM Store's P-side `LocalFeatureCache`. It is cachetools' `LRUCache` sized by tensor bytes, plus
an eviction count and a `put` that answers "never fits" with False instead of an exception.
Reads (`get`, `[]`) make an entry the most recent; `in` does not. Not thread-safe: an owner
shared by threads holds its own lock around every call, reads included (they reorder).
"""
from __future__ import annotations

from collections.abc import Sequence

import torch
from cachetools import LRUCache


def tensors_nbytes(tensors: Sequence[torch.Tensor]) -> int:
    """Bytes held by the elements of ``tensors`` (what an entry costs in a `ByteLRU`)."""
    return sum(t.numel() * t.element_size() for t in tensors)


class ByteLRU(LRUCache):
    def __init__(self, capacity_bytes: int):
        if not isinstance(capacity_bytes, int) or capacity_bytes <= 0:
            raise ValueError(f"capacity_bytes must be a positive int, got {capacity_bytes!r}")
        super().__init__(maxsize=capacity_bytes, getsizeof=tensors_nbytes)
        self.evictions = 0  # entries dropped to make room for another

    @property
    def capacity_bytes(self) -> int:
        return self.maxsize

    @property
    def nbytes(self) -> int:
        return self.currsize

    def put(self, key: str, tensors: Sequence[torch.Tensor]) -> bool:
        """Insert or replace ``key``, evicting least recently used entries; False (and ``key``
        absent) when the tensors alone exceed the capacity."""
        try:
            self[key] = list(tensors)
        except ValueError:  # cachetools: "value too large"
            self.pop(key, None)
            return False
        return True

    def popitem(self):
        item = super().popitem()  # cachetools calls this only to make room
        self.evictions += 1
        return item
