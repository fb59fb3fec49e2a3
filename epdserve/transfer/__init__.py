"""epdserve.transfer: what moves between stages, and the seams the engine sees it through.

- feature_provider.py  the E→P seam: `FeatureProvider` (contract), `FeatureStats`, `LocalFeatureProvider`
- byte_lru.py          `ByteLRU`: the byte-bounded LRU both feature caches keep their entries in
- mm_store/            the MM Store: features in a Redis-protocol server, event-driven prefetch to P
- kv/                  layerwise P→D KV transfer over two-rank process groups
"""
