"""The E→P seam: where encoded media features live between the encode and prefill stages.

`FeatureProvider` is the interface (the encoder twin of vLLM's ECConnector):
- encode side: `contains(key)` lets the encoder skip media it has seen; `save(...)` stores the
  features of one media item and tells the target prefill side (an event, in the MM Store);
- prefill side: `load(key, timeout_s)` returns the features, waiting at most `timeout_s`, or
  None, in which case the prefill stage recomputes them with its own vision encoder.
`LocalFeatureProvider` keeps features in this process (bounded LRU by bytes); the MM Store
implementation (`MMStoreFeatureProvider`) lives in epdserve.transfer.mm_store. The interface
sits in transfer/ (below engine/) so that implementations subclass it.
"""
from __future__ import annotations

from abc import ABC, abstractmethod
from collections import OrderedDict

import torch


class FeatureProvider(ABC):
    @abstractmethod
    def contains(self, key: str) -> bool: ...

    @abstractmethod
    def save(self, key: str, features: list[torch.Tensor], request_id: str = "", target: str | None = None) -> None: ...

    @abstractmethod
    def load(self, key: str, timeout_s: float = 0.0) -> list[torch.Tensor] | None: ...

    def stats(self) -> dict[str, int]:
        return {}

    def close(self) -> None:
        pass


class LocalFeatureProvider(FeatureProvider):
    """In-process feature cache, LRU-bounded by bytes."""

    def __init__(self, max_bytes: int = 1 << 30):
        self.max_bytes = max_bytes
        self._items: OrderedDict[str, list[torch.Tensor]] = OrderedDict()
        self._bytes = 0
        self.hits = 0
        self.misses = 0

    def contains(self, key: str) -> bool:
        return key in self._items

    def save(self, key, features, request_id="", target=None):
        if key in self._items:
            return
        size = sum(t.numel() * t.element_size() for t in features)
        self._items[key] = features
        self._bytes += size
        while self._bytes > self.max_bytes and len(self._items) > 1:
            _, old = self._items.popitem(last=False)
            self._bytes -= sum(t.numel() * t.element_size() for t in old)

    def load(self, key, timeout_s=0.0):
        feats = self._items.get(key)
        if feats is None:
            self.misses += 1
            return None
        self._items.move_to_end(key)
        self.hits += 1
        return feats

    def stats(self):
        return {"hits": self.hits, "misses": self.misses, "items": len(self._items), "bytes": self._bytes}
