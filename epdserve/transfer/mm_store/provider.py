"""`FeatureProvider` (the engine's E->P seam, epdserve/seams/feature_provider.py) over the MM Store.

One class, used by an engine in the role(s) it runs (`roles`, as in `EngineConfig.roles`; its
record in `epdserve/roles.py` says which sides it plays):

- encode side (it encodes and does not prefill): `contains` asks the store (a hit lets the encoder skip the
  item); `save` puts the features and then publishes {key, request id} to the target prefill
  instance's event stream (the request's target, else `default_target`).
- prefill side (it prefills): a `LocalFeatureCache` fed by a `PrefetchListener` on this
  instance's stream (when `instance_id` is given), read through a `FeatureFetcher`:
  `load(key, timeout_s)` returns the feature (local, in-flight prefetch, or store) or None,
  after which the engine waits (polling `load` each step) or recomputes; the engine counts its
  recomputes (`EncodeStage.recomputes`). `FeatureStats.misses` counts `load`s that returned None.
  With both sides in one engine (monolithic, P+E) `save` caches locally and stores;
  no event is needed.

Nothing here raises for an unreachable server: reads turn into misses and writes are skipped
and counted, so requests complete by local recompute; `ServerHealth` logs the outage once.
"""
from __future__ import annotations

import logging
from collections.abc import Sequence

import torch

from epdserve.roles import parse_roles
from epdserve.seams.byte_lru import tensors_nbytes
from epdserve.seams.feature_provider import FeatureProvider, FeatureStats
from epdserve.transfer.mm_store.cache import LocalFeatureCache
from epdserve.transfer.mm_store.connection import StoreUnavailableError
from epdserve.transfer.mm_store.events import EventPublisher, FeatureEvent
from epdserve.transfer.mm_store.fetcher import FeatureFetcher
from epdserve.transfer.mm_store.prefetch import PrefetchListener
from epdserve.transfer.mm_store.stats import Counters, feature_counters
from epdserve.transfer.mm_store.store import MMStoreError, RedisMMStore

logger = logging.getLogger(__name__)


class MMStoreFeatureProvider(FeatureProvider):
    def __init__(
        self,
        store: RedisMMStore,
        roles: str,
        *,
        instance_id: str | None = None,
        default_target: str | None = None,
        cache_bytes: int = 4 << 30,
        cache_device: str | torch.device | None = None,
        owns_store: bool = False,
        listener_replay_s: float = 30.0,
    ):
        rs = parse_roles(roles)
        self.store = store
        self.encodes = rs.encodes
        self.prefills = rs.prefills
        self.default_target = default_target
        self.owns_store = owns_store
        self.counters: Counters = feature_counters()
        self.cache: LocalFeatureCache | None = None
        self.fetcher: FeatureFetcher | None = None
        self.listener: PrefetchListener | None = None
        self.publisher = EventPublisher(store.connection, prefix=store.key_prefix)
        self._save_failure_logged = False
        if self.prefills:
            self.cache = LocalFeatureCache(cache_bytes, cache_device)
            self.fetcher = FeatureFetcher(store, self.cache, self.counters)
            if instance_id is not None:
                self.listener = PrefetchListener(
                    store, instance_id, self.cache, self.counters, replay_s=listener_replay_s,
                    prefix=store.key_prefix,
                ).start()

    # ---------------------------------------------------------------- FeatureProvider
    def contains(self, key: str) -> bool:
        if self.cache is not None and (key in self.cache or self.cache.is_inflight(key)):
            return True
        try:
            return self.store.exists(key)
        except StoreUnavailableError:
            return False

    def load(self, key: str, timeout_s: float = 0.0) -> list[torch.Tensor] | None:
        if self.fetcher is not None:
            return self.fetcher.get(key, timeout_s)
        try:
            feature = self.store.get(key, skip_corrupt=True)
        except StoreUnavailableError:
            feature = None
        if feature is None:
            self.counters.add("misses")
        else:
            self.counters.add("hits_store")
            self.counters.add("bytes_fetched", tensors_nbytes(feature))
        return feature

    def save(self, key: str, features: list[torch.Tensor], request_id: str = "",
             target: str | None = None) -> None:
        if self.cache is not None:
            self.cache.put(key, features)
        if not self._put(key, features):
            return
        target = target or self.default_target
        if self.encodes and not self.prefills and target is not None:
            try:
                self.publisher.publish(target, FeatureEvent(key, request_id))
                self.counters.add("events_published")
            except StoreUnavailableError:
                pass

    def drop(self, key: str) -> bool:
        if self.cache is not None:
            self.cache.discard(key)
        try:
            return self.store.delete(key)
        except StoreUnavailableError:
            return False

    def stats(self) -> FeatureStats:
        """The path's counters with the local cache's size and the store's health.
        The store's own counters (gets, puts, corrupt values ...) are `self.store.stats()`."""
        cache = self.cache.stats() if self.cache is not None else {}
        store = self.store.stats()
        return FeatureStats(
            **self.counters.snapshot(),
            cached_entries=cache.get("entries", 0), cached_bytes=cache.get("bytes", 0),
            cache_capacity_bytes=cache.get("capacity_bytes", 0), cache_evictions=cache.get("evictions", 0),
            inflight=cache.get("inflight", 0),
            store_up=bool(store["server_up"]), store_outages=int(store["outages"]),
        )

    def close(self) -> None:
        if self.listener is not None:
            self.listener.stop()
            self.listener = None
        if self.owns_store:
            self.store.close()

    # ---------------------------------------------------------------- helpers
    def _put(self, key: str, features: Sequence[torch.Tensor]) -> bool:
        try:
            self.store.put(key, features)
        except StoreUnavailableError:
            self.counters.add("save_failures")
            return False
        except MMStoreError as e:  # e.g. full with noeviction: say so once, count the rest
            self.counters.add("save_failures")
            if not self._save_failure_logged:
                self._save_failure_logged = True
                logger.warning("%s; features not stored are recomputed by prefill (further "
                               "failures counted in stats().save_failures)", e)
            return False
        self.counters.add("saves")
        self.counters.add("bytes_stored", tensors_nbytes(features))
        return True
