"""The E→P seam: where encoded media features live between the encode and prefill stages.

`FeatureProvider` is the interface (the encoder twin of vLLM's ECConnector); its methods state
their contracts. In short:
- encode side: `contains(key)` lets the encoder skip media it has seen; `save(...)` stores the
  features of one media item and tells the target prefill side (an event, in the MM Store);
- prefill side: `load(key, timeout_s)` returns the features, waiting at most `timeout_s`, or
  None, in which case the prefill stage recomputes them with its own vision encoder;
- `stats()` returns one `FeatureStats` snapshot whatever the implementation;
- `drop(key)` forgets a key's features (a deleted upload).
`LocalFeatureProvider` keeps features in this process (a `ByteLRU`): the engine's default when
it is given none. The MM Store implementation (`MMStoreFeatureProvider`) lives in
epdserve.transfer.mm_store; the interface sits in seams/ (below engine/ and transfer/) so that
the engine calls it and implementations subclass it without either importing the other.
"""
from __future__ import annotations

import threading
from abc import ABC, abstractmethod
from dataclasses import dataclass

import torch

from epdserve.seams.byte_lru import ByteLRU


@dataclass(frozen=True)
class FeatureStats:
    """Counters of one `FeatureProvider` since it was made, plus its cache's size now.

    Fields an implementation has no use for stay at their defaults (the in-process provider
    publishes no events and has no store).
    """

    hits_local: int = 0  # `load`s served from this process's memory
    hits_store: int = 0  # `load`s read from the shared store on the request path
    misses: int = 0  # `load`s that returned None (the caller waits more or recomputes)
    waits: int = 0  # `load`s that waited for a prefetch already in flight
    prefetches: int = 0  # features moved into the local cache ahead of their request
    events: int = 0  # feature events received by the prefetch listener
    events_published: int = 0  # feature events sent to a prefill instance
    saves: int = 0  # `save`s that stored the features
    save_failures: int = 0  # `save`s that could not store them (prefill will recompute)
    bytes_fetched: int = 0  # payload bytes moved store -> this process
    bytes_stored: int = 0  # payload bytes moved this process -> store
    cached_entries: int = 0  # media items in the local cache now
    cached_bytes: int = 0  # bytes they hold
    cache_capacity_bytes: int = 0  # the local cache's bound (0: no local cache)
    cache_evictions: int = 0  # entries the local cache dropped to make room
    inflight: int = 0  # prefetches in flight now
    store_up: bool = True  # the shared store answered its last call (True without a store)
    store_outages: int = 0  # times the shared store went from up to down

    @property
    def hits(self) -> int:
        return self.hits_local + self.hits_store

    @property
    def lookups(self) -> int:
        return self.hits + self.misses


class FeatureProvider(ABC):
    """Features of media items by media key (`seams.media_keys.media_key`), shared E -> P.

    The engine calls `contains`, `save` and `load` from its loop thread, one call at a time;
    `stats` may be called from any thread. No method raises because a store is unreachable:
    reads turn into misses and writes are skipped and counted, so requests complete by recompute.
    """

    @abstractmethod
    def contains(self, key: str) -> bool:
        """Whether prefill can get ``key``'s features without this engine encoding them.

        Called by an encode-only engine (E without P) before it encodes a media item; True
        skips the encoder. May block for one short store round trip; False when unsure
        (store unreachable), so the worst case is encoding again.
        """

    @abstractmethod
    def save(self, key: str, features: list[torch.Tensor], request_id: str = "", target: str | None = None) -> None:
        """Make ``features`` (the vision encoder's output for media ``key``) loadable by prefill.

        Called by an engine whose roles include E, right after it encoded the item.
        ``request_id`` names the request that needed it and ``target`` the prefill instance
        to tell (else the provider's default); an implementation that notifies prefill sides
        does so after the features are stored. May block for one store write; a failed write
        is counted in `save_failures` and otherwise ignored (prefill recomputes). The caller
        must not modify the tensors afterwards: implementations may keep them as they are.
        """

    @abstractmethod
    def load(self, key: str, timeout_s: float = 0.0) -> list[torch.Tensor] | None:
        """``key``'s features, or None when they cannot be had within ``timeout_s``.

        Called by an engine whose roles include P, each step while a request waits for the
        features (the engine polls with ``timeout_s=0`` rather than block its loop). May block
        up to ``timeout_s`` (an implementation may wait briefly for a fetch already in flight
        even at 0). None means "not here now": the caller polls again or recomputes. The
        returned tensors may be shared with a cache: read them, never modify them in place.
        """

    def drop(self, key: str) -> bool:
        """Forget ``key``'s features (a deleted upload); True if they were there. Later `load`s
        miss, so prefill recomputes. Default: nothing to drop."""
        return False

    def stats(self) -> FeatureStats:
        """A snapshot of this provider's counters; cheap, never touches the network."""
        return FeatureStats()

    def close(self) -> None:
        """Release threads and connections. Called once by the owner after its engine stopped;
        no other method is called afterwards."""


class LocalFeatureProvider(FeatureProvider):
    """Features kept in this process (one engine, or engines sharing it), LRU-bounded by bytes.

    Features larger than the whole bound are not kept (`save_failures`): prefill recomputes.
    """

    def __init__(self, max_bytes: int = 1 << 30):
        self._lru = ByteLRU(max_bytes)
        self._lock = threading.Lock()
        self._hits = self._misses = self._saves = self._save_failures = 0

    def contains(self, key: str) -> bool:
        with self._lock:
            return key in self._lru

    def save(self, key, features, request_id="", target=None):
        with self._lock:
            if key in self._lru:  # the same key always means the same features
                return
            if self._lru.put(key, features):
                self._saves += 1
            else:
                self._save_failures += 1

    def load(self, key, timeout_s=0.0):
        with self._lock:
            feats = self._lru.get(key)
            if feats is None:
                self._misses += 1
            else:
                self._hits += 1
            return feats

    def drop(self, key):
        with self._lock:
            return self._lru.pop(key, None) is not None

    def stats(self) -> FeatureStats:
        with self._lock:
            return FeatureStats(
                hits_local=self._hits, misses=self._misses, saves=self._saves, save_failures=self._save_failures,
                cached_entries=len(self._lru), cached_bytes=self._lru.nbytes,
                cache_capacity_bytes=self._lru.capacity_bytes, cache_evictions=self._lru.evictions,
            )
