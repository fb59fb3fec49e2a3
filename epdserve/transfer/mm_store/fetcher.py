"""P side: get a media item's features for prefill, or say "recompute".

`FeatureFetcher.get(key, timeout_s)` tries, in order: the local cache; a prefetch of the key
already in flight (waited for, at least `inflight_wait_s` even when ``timeout_s`` is 0, since
reading the store instead would move the same bytes twice); the store; then, while ``timeout_s`` lasts, the arrival of the
key through the prefetch listener (and one last store read at the deadline). None means
"recompute locally": the caller runs its own vision encoder (and counts that itself).

When the server is down the store fails fast (see connection.py), so `get` returns None at once
instead of waiting out ``timeout_s``: no event can arrive either.
"""
from __future__ import annotations

import time

import torch

from epdserve.seams.byte_lru import tensors_nbytes
from epdserve.transfer.mm_store.cache import LocalFeatureCache
from epdserve.transfer.mm_store.connection import StoreUnavailableError
from epdserve.transfer.mm_store.stats import Counters, feature_counters
from epdserve.transfer.mm_store.store import RedisMMStore


class FeatureFetcher:
    def __init__(self, store: RedisMMStore, cache: LocalFeatureCache, counters: Counters | None = None,
                 inflight_wait_s: float = 0.05):
        if inflight_wait_s < 0:
            raise ValueError(f"inflight_wait_s must be >= 0, got {inflight_wait_s}")
        self.store = store
        self.inflight_wait_s = inflight_wait_s
        self.cache = cache
        self.counters = counters if counters is not None else feature_counters()

    def get(self, key: str, timeout_s: float = 0.0) -> list[torch.Tensor] | None:
        if timeout_s < 0:
            raise ValueError(f"timeout_s must be >= 0, got {timeout_s}")
        deadline = time.monotonic() + timeout_s
        feature = self.cache.get(key)
        if feature is not None:
            self.counters.add("hits_local")
            return feature
        if self.cache.is_inflight(key):
            self.counters.add("waits")
            wait = max(deadline - time.monotonic(), self.inflight_wait_s)
            feature = self.cache.wait_for(key, wait, inflight_only=True)
            if feature is not None:
                self.counters.add("hits_local")
                return feature
        try:
            feature = self._from_store(key)
            if feature is None and deadline > time.monotonic():
                feature = self.cache.wait_for(key, deadline - time.monotonic())
                if feature is not None:
                    self.counters.add("hits_local")
                    return feature
                feature = self._from_store(key)
        except StoreUnavailableError:
            feature = None
        if feature is None:
            self.counters.add("misses")
        return feature

    def stats(self) -> dict[str, int]:
        return self.counters.snapshot()

    def _from_store(self, key: str) -> list[torch.Tensor] | None:
        feature = self.store.get(key, skip_corrupt=True)
        if feature is None:
            return None
        self.counters.add("hits_store")
        self.counters.add("bytes_fetched", tensors_nbytes(feature))
        self.cache.put(key, feature)
        return self.cache.get(key) or feature
