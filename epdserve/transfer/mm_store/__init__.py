"""MM Store: the E->P hop. Hash-keyed media features in Redis, event-driven prefetch into a
P-side local cache, and "recompute locally" when a feature cannot be had in time. Features are
keyed by media key (epdserve.seams.media_keys).

One sentence per module:
- codec.py       binary value layout of a list of tensors (never pickle), CorruptFeatureError
- server.py      LocalRedisServer: a private Redis-protocol server on a free loopback port
- urls.py        MM Store URLs: redis://, rediss://, unix://, redis+cluster://, redis+sentinel://; redaction
- topology.py    the redis-py client for a URL (Redis, RedisCluster, Sentinel.master_for); node-routed XREAD/TIME
- connection.py  that client with short timeouts + ServerHealth (backoff, one warning per outage)
- store.py       RedisMMStore: put/get of features under media keys, its contract, MMStoreError
- events.py      FeatureEvent and EventPublisher over Redis Streams (why Streams: see there)
- cache.py       LocalFeatureCache: LRU by bytes, in-flight tracking, optional device placement
- prefetch.py    PrefetchListener thread: events -> store -> local cache
- fetcher.py     FeatureFetcher.get(key, timeout_s): cache, in-flight wait, store, or None
- stats.py       thread-safe counters (the provider reports them as `FeatureStats`)
- provider.py    MMStoreFeatureProvider: the `FeatureProvider` over the store, events, prefetch and cache
"""
from epdserve.transfer.mm_store.cache import LocalFeatureCache
from epdserve.transfer.mm_store.codec import CorruptFeatureError
from epdserve.transfer.mm_store.connection import RedisConnection, StoreUnavailableError
from epdserve.transfer.mm_store.events import EventPublisher, FeatureEvent
from epdserve.transfer.mm_store.fetcher import FeatureFetcher
from epdserve.transfer.mm_store.prefetch import PrefetchListener
from epdserve.transfer.mm_store.server import LocalRedisServer
from epdserve.transfer.mm_store.stats import feature_counters
from epdserve.transfer.mm_store.store import MMStoreError, RedisMMStore

__all__ = [
    "CorruptFeatureError",
    "EventPublisher",
    "FeatureEvent",
    "FeatureFetcher",
    "LocalFeatureCache",
    "LocalRedisServer",
    "MMStoreError",
    "PrefetchListener",
    "RedisConnection",
    "RedisMMStore",
    "StoreUnavailableError",
    "feature_counters",
]
