"""Block manager: KV blocks, each request's block table, and the prefix cache over them.

Every block is in one of three places: the free list (no content worth keeping), the cached
free list (unreferenced, but it holds the KV of a full block whose hash is known: reusable
until evicted, least recently freed first), or one or more requests' tables (its reference
count). A full block's key (seams/prefix_hash.py `BlockKey`: a SHA-256 digest chaining its
tokens and media identity to everything before it, and the content it hashed) names one prefix;
`lookup` finds the longest cached run of a request's keys — a block is a hit only when its
recorded content equals the request's (token ids, media identity, parent digest), so a block
whose digest collides with another prompt's is a miss, never served, on P and on D (whose
imported KV is looked up the same way) —, `adopt` starts its table with those blocks, `cache`
records the keys of blocks a request has computed (the first block under a digest keeps it). `free(request)` drops its references; a block that reaches zero goes to the
cached free list if it has a hash, else to the free list. `grow` takes free blocks first, then
evicts cached ones. With `prefix_caching=False` nothing is hashed and the cached list stays empty.
The scheduler is the only caller.
"""
from __future__ import annotations

import logging
from array import array
from collections import OrderedDict, deque

from epdserve.seams.prefix_hash import BlockKey

log = logging.getLogger(__name__)


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int, prefix_caching: bool = False):
        if num_blocks < 1 or block_size < 1:
            raise ValueError("num_blocks and block_size must be >= 1")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.prefix_caching = prefix_caching
        self._free: deque[int] = deque(range(num_blocks))
        self._cached_free: OrderedDict[int, bytes] = OrderedDict()  # block -> digest, oldest first
        self._tables: dict[str, array] = {}  # int64 block ids, copied in C
        self._seen: dict[str, int] = {}  # request -> leading blocks of its table `cache` has been through
        self._refs = [0] * num_blocks
        self._key_of: dict[int, BlockKey] = {}  # block -> key of the prefix it holds
        self._block_of: dict[bytes, int] = {}  # digest -> block
        self.evictions = 0
        self.mismatches = 0  # lookups that found a digest with other content (forged, or a broken hash)

    @property
    def num_free(self) -> int:
        """Blocks `grow` can hand out: free ones and cached ones it may evict."""
        return len(self._free) + len(self._cached_free)

    @property
    def num_cached(self) -> int:
        return len(self._block_of)

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
            table.append(self._take())
        return table

    def free(self, request_id: str) -> None:
        self.truncate(request_id, 0)

    def truncate(self, request_id: str, keep_blocks: int) -> None:
        """Drop the request's references to all but its first `keep_blocks` blocks (tail first,
        so a prefix's first blocks are the last ones evicted)."""
        table = self._tables.get(request_id)
        if table is None:
            return
        for b in reversed(table[keep_blocks:]):
            self._release(b)
        if keep_blocks:
            del table[keep_blocks:]
            self._seen[request_id] = min(self._seen.get(request_id, 0), keep_blocks)
        else:
            del self._tables[request_id]
            self._seen.pop(request_id, None)

    def hold(self, blocks) -> None:
        """One more reference to each of `blocks`, owned by no request (a pending device copy
        reads or writes them): nothing else gets them until `release`."""
        for b in blocks:
            if self._refs[b] == 0 and self._cached_free.pop(b, None) is None:
                self._free.remove(b)
            self._refs[b] += 1

    def release(self, blocks) -> None:
        """Drop the references `hold` took."""
        for b in blocks:
            self._release(b)

    def slots(self, request_id: str, start: int, end: int) -> list[int]:
        """Flat slot indices of token positions [start, end)."""
        table, bs = self._tables[request_id], self.block_size
        return [table[p // bs] * bs + p % bs for p in range(start, end)]

    # ---------------------------------------------------------------- prefix cache
    def lookup(self, keys: list[BlockKey]) -> list[int]:
        """The cached blocks of the longest prefix of `keys` (one per full block) whose recorded
        content equals the request's: equal digests alone serve nothing."""
        out = []
        for k in keys:
            b = self._block_of.get(k.digest)
            if b is None:
                break
            if self._key_of[b].content != k.content:
                self.mismatches += 1
                log.warning("prefix cache: block %d is cached under the digest of a block with other content "
                            "(forged or a broken hash); a miss, not served", b)
                break
            out.append(b)
        return out

    def adopt(self, request_id: str, blocks: list[int]) -> None:
        """Start `request_id`'s (empty) table with cached `blocks`."""
        if self._tables.get(request_id):
            raise ValueError(f"{request_id} already has blocks")
        table = self._tables.setdefault(request_id, array("q"))
        for b in blocks:
            if self._refs[b] == 0:
                del self._cached_free[b]
            self._refs[b] += 1
            table.append(b)
        self._seen[request_id] = len(blocks)  # cached blocks: their hashes are known

    def uncached_from(self, request_id: str) -> int:
        """The first block of the request's table that `cache` has not been through."""
        return self._seen.get(request_id, 0)

    def cache(self, request_id: str, keys: list[BlockKey]) -> None:
        """Record the keys of the request's first len(keys) blocks, which hold computed KV (a
        digest already held by another block stays with that one); blocks already gone through
        are skipped, so a request's blocks are each looked at once."""
        if not self.prefix_caching:
            return
        table = self._tables.get(request_id, ())
        start = self._seen.get(request_id, 0)
        for i in range(start, min(len(table), len(keys))):
            b, k = table[i], keys[i]
            if b in self._key_of or k.digest in self._block_of:
                continue
            self._key_of[b] = k
            self._block_of[k.digest] = b
        self._seen[request_id] = max(start, min(len(table), len(keys)))

    # ---------------------------------------------------------------- internals
    def _take(self) -> int:
        if self._free:
            b = self._free.popleft()
        else:
            b, d = self._cached_free.popitem(last=False)  # least recently freed
            del self._key_of[b], self._block_of[d]
            self.evictions += 1
        self._refs[b] = 1
        return b

    def _release(self, b: int) -> None:
        self._refs[b] -= 1
        if self._refs[b] > 0:
            return
        k = self._key_of.get(b)
        if k is None:
            self._free.append(b)
        else:
            self._cached_free[b] = k.digest
