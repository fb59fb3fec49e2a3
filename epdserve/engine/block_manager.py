"""Block manager: the free list of KV blocks and each request's block table.

Invariant: a block is either on the free list or in exactly one request's table; `free(seq)`
returns every block of that request. The scheduler is the only caller.
"""
from __future__ import annotations

from array import array
from collections import deque


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int):
        if num_blocks < 1 or block_size < 1:
            raise ValueError("num_blocks and block_size must be >= 1")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self._free: deque[int] = deque(range(num_blocks))
        self._tables: dict[str, array] = {}  # int64 block ids, copied in C

    @property
    def num_free(self) -> int:
        return len(self._free)

    def blocks_needed(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def table(self, request_id: str) -> list[int]:
        return self._tables.get(request_id, [])

    def extra_blocks_for(self, request_id: str, num_tokens: int) -> int:
        """Blocks to add so that `request_id` can hold `num_tokens` tokens."""
        return max(0, self.blocks_needed(num_tokens) - len(self.table(request_id)))

    def can_grow(self, request_id: str, num_tokens: int, reserve: int = 0) -> bool:
        return self.extra_blocks_for(request_id, num_tokens) + reserve <= self.num_free

    def grow(self, request_id: str, num_tokens: int) -> list[int]:
        """Extend the table to hold `num_tokens`; raises MemoryError if the free list is short."""
        need = self.extra_blocks_for(request_id, num_tokens)
        if need > self.num_free:
            raise MemoryError(f"need {need} KV blocks, {self.num_free} free")
        table = self._tables.setdefault(request_id, array("q"))
        for _ in range(need):
            table.append(self._free.popleft())
        return table

    def free(self, request_id: str) -> None:
        for b in self._tables.pop(request_id, []):
            self._free.append(b)

    def slots(self, request_id: str, start: int, end: int) -> list[int]:
        """Flat slot indices of token positions [start, end)."""
        table, bs = self._tables[request_id], self.block_size
        return [table[p // bs] * bs + p % bs for p in range(start, end)]
