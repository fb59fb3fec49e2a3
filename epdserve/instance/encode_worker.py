"""E worker: encodes media into the MM Store and tells the target prefill instance.

Request lifecycle: `submit` (gRPC thread; media already preprocessed) → the engine's encode
stage (items already in the store are skipped, the rest batched through the vision tower) →
features `save`d to the provider (store put, then a feature event to `target`) → the request's
handle gets its finished `RequestOutput` ("encoded", or "error"). Each item's `from_store`
tells whether the encoder ran for it.
"""
from __future__ import annotations

from epdserve.engine.sequence import MediaItem
from epdserve.instance.worker import CALL_TIMEOUT_S, RequestHandle, StageWorker, WorkerLoad


class EncodeWorker(StageWorker):
    role = "E"

    def submit(self, request_id: str, media: list[MediaItem], target: str | None) -> RequestHandle:
        handle = RequestHandle(request_id)

        def add():
            if request_id in self.handles:
                raise ValueError(f"request {request_id!r} is already being encoded here")
            self.handles[request_id] = handle
            self.engine.add_encode_request(request_id, media, feature_target=target or None)

        self.call(add).result(CALL_TIMEOUT_S)
        return handle

    def abort(self, request_id: str):
        def run():
            found = request_id in self.handles
            self.engine.abort(request_id)
            return found

        return self.call(run)

    def tick(self) -> None:
        for out in self.engine.step():
            if out.finished:
                handle = self.handles.pop(out.request_id, None)
                if handle is not None:
                    handle.put(out)

    def on_step_error(self) -> None:
        for rid, handle in list(self.handles.items()):
            self.engine.abort(rid)
            handle.put(RuntimeError("encode step failed"))
        self.handles.clear()

    def on_stop(self) -> None:
        for handle in self.handles.values():
            handle.put(RuntimeError("encode worker stopped"))
        self.handles.clear()

    def compute_load(self) -> WorkerLoad:
        return self.engine_load(counts_kv=False)
