"""epdserve.seams: the two connector interfaces between the engine and what moves between stages.

Owns the contracts the engine calls and transfer/ implements, and what both sides share, so that
neither imports the other (as vLLM keeps its KV and encoder-cache connector bases side by side).
Implementations are built above both, in instance/ (InstanceHost picks a provider and connectors).
It also holds what the engine and the scheduler must compute alike: media keys and the prefix hash
(the router's index is keyed by the engines' own block digests). Imports nothing of epdserve above it.

- kv_connector.py      the P→D seam: `KVConnector` (contract), `RemoteDecode` / `RemotePrefill`, `FinishedTransfer`
- feature_provider.py  the E→P seam: `FeatureProvider` (contract), `FeatureStats`, `LocalFeatureProvider`
- media_keys.py        media identity: `media_key` (keyed BLAKE2b of raw bytes, `MediaKeySecret`) and `namespace_for` (model/processor)
- prefix_hash.py       the one prefix hash: chained SHA-256 keys of full KV blocks (engine cache, router index)
- byte_lru.py          `ByteLRU`: the byte-bounded LRU both feature caches keep their entries in
"""
