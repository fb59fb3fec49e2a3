"""`PrefixIndex`: which prompt prefixes each instance probably holds in its prefix cache.

An approximate index built from the scheduler's own routing history (as llm-d's approximate
prefix-cache scorer does), not from instance reports: when the router sends a request to an
instance it records the prompt's block hashes (`prompt_chunks.py`: the engines' own prefix-cache
digests, in blocks of that instance's size) there, and it scores a later request by how many of
its leading blocks an instance was sent. No RPC, nothing to keep in sync
with the engines, and it lives and dies with the scheduler, as the scheduler's view of where it
sent work should; the price is that an engine's own eviction is not seen (a stale guess costs
only a prefill the request would have paid anyway).

Bounds and lifetimes: per instance an LRU of at most `capacity` block hashes (a prompt's blocks
are recorded last-first, so a prompt's first blocks, shared by every later turn, are the last of
it evicted, as engines free a request's blocks tail first). An instance's entries go when it goes
DOWN or leaves the roster (`forget`, the router's registry listener) and when it comes back as
another process (its pid or address differ from those its entries were recorded under: a
restarted engine has an empty cache). A role switch registers under a new id, which starts empty.
One event loop owns it (the scheduler's); no locks.
"""
from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence

from epdserve.scheduler.registry import InstanceRecord

DEFAULT_CAPACITY = 131_072  # block hashes per instance: 2M tokens of 16-token blocks, 20 MB (tracemalloc)


class PrefixIndex:
    def __init__(self, capacity: int = DEFAULT_CAPACITY):
        if capacity < 1:
            raise ValueError("capacity must be >= 1")
        self.capacity = capacity
        self._chunks: dict[str, OrderedDict[bytes, None]] = {}
        self._incarnation: dict[str, tuple[int, str]] = {}  # instance id -> (pid, address) recorded under

    def matched(self, rec: InstanceRecord, hashes: Sequence[bytes]) -> int:
        """How many leading blocks of `hashes` `rec` was sent (the longest matched run)."""
        chunks = self._current(rec)
        if not chunks:
            return 0
        n = 0
        for h in hashes:
            if h not in chunks:
                break
            n += 1
        return n

    def record(self, rec: InstanceRecord, hashes: Sequence[bytes]) -> None:
        """`rec` was sent a prompt with these block hashes: it will hold them."""
        if not hashes:
            return
        chunks = self._current(rec)
        if chunks is None:
            chunks = self._chunks[rec.instance_id] = OrderedDict()
            self._incarnation[rec.instance_id] = (rec.pid, rec.address)
        for h in reversed(hashes):  # the first block most recent: evicted last
            chunks[h] = None
            chunks.move_to_end(h)
        while len(chunks) > self.capacity:
            chunks.popitem(last=False)

    def forget(self, instance_id: str) -> None:
        """Drop everything recorded for `instance_id` (it died, left, or restarted)."""
        self._chunks.pop(instance_id, None)
        self._incarnation.pop(instance_id, None)

    def size(self, instance_id: str) -> int:
        """Block hashes held for `instance_id`."""
        return len(self._chunks.get(instance_id, ()))

    def instances(self) -> list[str]:
        """Ids with entries."""
        return sorted(self._chunks)

    def _current(self, rec: InstanceRecord) -> OrderedDict[bytes, None] | None:
        """`rec`'s chunks, dropped first if they were recorded under another process."""
        seen = self._incarnation.get(rec.instance_id)
        if seen is not None and seen != (rec.pid, rec.address):
            self.forget(rec.instance_id)
        return self._chunks.get(rec.instance_id)
