"""P-side local feature cache: a `ByteLRU` with in-flight tracking for prefetches.

Entries live in host memory, or on ``device`` when one is given (moved once, on insert), so a
prefetched feature is ready for the prefill's embedding merge without another copy.

In-flight protocol (listener thread vs. request path): the listener `mark_inflight`s the keys it
is about to fetch, then `put`s or `abandon`s each; a request that finds its key in flight can
`wait_for` it with a bounded timeout instead of fetching the same bytes a second time. Every
change notifies one condition variable; waiters re-check their own key.
"""
from __future__ import annotations

import threading
import time
from collections.abc import Iterable, Sequence

import torch

from epdserve.seams.byte_lru import ByteLRU


class LocalFeatureCache:
    def __init__(self, capacity_bytes: int, device: str | torch.device | None = None):
        self._entries = ByteLRU(capacity_bytes)
        self.device = torch.device(device) if device is not None else None
        self._inflight: set[str] = set()
        self._cond = threading.Condition()

    @property
    def capacity_bytes(self) -> int:
        return self._entries.capacity_bytes

    def get(self, key: str) -> list[torch.Tensor] | None:
        with self._cond:
            entry = self._entries.get(key)
            return None if entry is None else list(entry)

    def __contains__(self, key: str) -> bool:
        with self._cond:
            return key in self._entries

    def put(self, key: str, tensors: Sequence[torch.Tensor]) -> bool:
        """Insert (evicting least recently used entries); False if it can never fit."""
        if self.device is not None:
            tensors = [t.to(self.device) for t in tensors]
        with self._cond:
            self._inflight.discard(key)
            fits = self._entries.put(key, tensors)
            self._cond.notify_all()
        return fits

    def discard(self, key: str) -> None:
        with self._cond:
            self._entries.pop(key, None)

    def mark_inflight(self, keys: Iterable[str]) -> list[str]:
        """Mark the keys neither cached nor already in flight; returns those (in order, unique)."""
        marked = []
        with self._cond:
            for k in keys:
                if k not in self._entries and k not in self._inflight:
                    self._inflight.add(k)
                    marked.append(k)
        return marked

    def abandon(self, keys: Iterable[str]) -> None:
        """The fetch of these in-flight keys failed or found nothing."""
        with self._cond:
            self._inflight.difference_update(keys)
            self._cond.notify_all()

    def is_inflight(self, key: str) -> bool:
        with self._cond:
            return key in self._inflight

    def wait_for(self, key: str, timeout_s: float, inflight_only: bool = False) -> list[torch.Tensor] | None:
        """Wait up to ``timeout_s`` for ``key`` to be cached.

        With ``inflight_only`` stop as soon as the key is no longer in flight (its fetch ended).
        """
        deadline = time.monotonic() + max(0.0, timeout_s)
        with self._cond:
            while key not in self._entries:
                if inflight_only and key not in self._inflight:
                    return None
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    return None
                self._cond.wait(remaining)
            return list(self._entries[key])

    def stats(self) -> dict[str, int]:
        with self._cond:
            return {
                "entries": len(self._entries),
                "bytes": self._entries.nbytes,
                "capacity_bytes": self.capacity_bytes,
                "evictions": self._entries.evictions,
                "inflight": len(self._inflight),
            }
