"""E worker: encodes media into the MM Store and tells the target prefill instance.

An adapter only: the Encode RPC's media (already preprocessed) become an `EngineRequest` with
no prompt; the encode-only engine skips items already stored, batches the rest through the
vision tower, saves the features to its provider (store put, then a feature event to the
target) and reports the request handed off (or failed) on the handle.
"""
from __future__ import annotations

from epdserve.engine.engine_request import EngineRequest
from epdserve.engine.request_parts import MediaItem, TenantShare
from epdserve.instance.worker import RequestHandle, StageWorker, WorkerLoad


class EncodeWorker(StageWorker):
    role = "E"

    def encode(self, request_id: str, media: list[MediaItem], target: str | None,
               tenant: TenantShare = TenantShare()) -> RequestHandle:
        return self.submit(EngineRequest(request_id, [], media, feature_target=target or None, tenant=tenant))

    def compute_load(self) -> WorkerLoad:
        return self.engine_load(counts_kv=False)
