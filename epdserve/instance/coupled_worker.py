"""Coupled worker (roles PD or EPD): the whole request in one engine's step loop.

EPD (monolithic) encodes media itself, finding features other requests already stored in the
MM Store; PD (mode E-PD) gets features from separate E instances through the store (prefetch
listener, bounded wait, recompute on a miss). Each engine output goes to the request's handle.
"""
from __future__ import annotations

from epdserve.engine.sampling_params import SamplingParams
from epdserve.engine.sequence import MediaItem
from epdserve.instance.errors import TransientError
from epdserve.instance.worker import CALL_TIMEOUT_S, RequestHandle, StageWorker


class CoupledWorker(StageWorker):
    role = "PD"

    def submit(self, request_id: str, token_ids: list[int], media: list[MediaItem],
               params: SamplingParams) -> RequestHandle:
        handle = RequestHandle(request_id)

        def add():
            if request_id in self.handles:
                raise ValueError(f"request {request_id!r} is already in flight here")
            self.handles[request_id] = handle
            self.engine.add_processed(request_id, token_ids, media, params)

        self.call(add).result(CALL_TIMEOUT_S)
        return handle

    def abort(self, request_id: str):
        def run():
            handle = self.handles.pop(request_id, None)
            self.engine.abort(request_id)
            if handle is not None:
                handle.put(TransientError("aborted"))
            return handle is not None

        return self.call(run)

    def tick(self) -> None:
        for out in self.engine.step():
            handle = self.handles.get(out.request_id)
            if handle is None:
                continue
            if out.finished:
                del self.handles[out.request_id]
            handle.put(out)

    def on_step_error(self) -> None:
        for rid, handle in list(self.handles.items()):
            self.engine.abort(rid)
            handle.put(TransientError("step failed"))
        self.handles.clear()

    def on_stop(self) -> None:
        for handle in self.handles.values():
            handle.put(RuntimeError("worker stopped"))
        self.handles.clear()
