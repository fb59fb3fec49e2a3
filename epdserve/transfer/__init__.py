"""epdserve.transfer: what moves between stages — the implementations of epdserve.seams' interfaces.

Imports the seams, never the engine.

- mm_store/            the MM Store: features in a Redis-protocol server, event-driven prefetch to P
                       (`MMStoreFeatureProvider`, a `FeatureProvider`)
- kv/                  layerwise P→D KV transfer over one process group per P–D pair, every rank of both (the `KVConnector`s)
"""
