"""Uploaded media (encode on upload): file id → the image's bytes, media key and grid, per owner.

An upload is validated and keyed like a request's image, encoded by an E instance at once (its
features land in the MM Store with the store's TTL), and kept here: the bytes, so that features
the MM Store no longer has (expired, evicted) are recomputed from them exactly by the prefilling
instance; the key and grid, so that a request referencing the file is prepared without decoding
it again. A file lives `ttl_s` seconds (or until deleted, or pushed out by the `max_bytes`
bound, least recently used first); after that its id is NOT_FOUND — the bytes are gone, so
nothing could recompute its features.

Ids belong to their owner, the uploader's tenant (`security/tenants.py`; the fronts'
`caller_tenant`): a lookup under another tenant is NOT_FOUND,
exactly as an unknown id, so ids cannot be probed. Thread-safe (a lock): the HTTP front and the
gRPC servicer share one `Uploads` on the scheduler's loop, `prepare` reads it in worker threads.
"""
from __future__ import annotations

import secrets
import threading
import time
from collections import OrderedDict
from dataclasses import dataclass

from epdserve.scheduler.errors import RequestError

FILE_URL_SCHEME = "epdserve-file://"  # an image_url naming an upload: epdserve-file://<file id>


@dataclass
class UploadedFile:
    file_id: str
    owner: str
    filename: str
    data: bytes
    key: str  # the media key (seams/media_keys.py)
    grid_thw: list[int]
    num_tokens: int
    created_at: float  # Unix seconds
    expires_at: float
    encoded: bool = False  # an E instance answered that the features are stored


class Uploads:
    def __init__(self, ttl_s: float = 3600.0, max_bytes: int = 1 << 30, clock=time.time):
        if ttl_s <= 0 or max_bytes <= 0:
            raise ValueError("ttl_s and max_bytes must be positive")
        self.ttl_s, self.max_bytes, self._clock = ttl_s, max_bytes, clock
        self._files: OrderedDict[str, UploadedFile] = OrderedDict()
        self._bytes = 0
        self._lock = threading.Lock()

    def add(self, owner: str, filename: str, data: bytes, key: str, grid_thw: list[int], num_tokens: int
            ) -> UploadedFile:
        if len(data) > self.max_bytes:
            raise RequestError.exhausted(f"the file ({len(data)} bytes) exceeds the upload store ({self.max_bytes} bytes)")
        now = self._clock()
        f = UploadedFile(f"file-{secrets.token_hex(12)}", owner, filename, data, key, list(grid_thw), num_tokens,
                         now, now + self.ttl_s)
        with self._lock:
            self._files[f.file_id] = f
            self._bytes += len(data)
            while self._bytes > self.max_bytes:
                self._drop(next(iter(self._files)))
        return f

    def get(self, owner: str, file_id: str) -> UploadedFile:
        """The owner's live file; NOT_FOUND for an unknown, expired, deleted or someone else's id."""
        with self._lock:
            f = self._files.get(file_id)
            if f is not None and f.expires_at <= self._clock():
                self._drop(file_id)
                f = None
            if f is None or not secrets.compare_digest(f.owner, owner):
                raise RequestError.not_found(f"no file {file_id!r} (never uploaded by this caller, deleted, or expired)")
            self._files.move_to_end(file_id)
            return f

    def remove(self, owner: str, file_id: str) -> UploadedFile:
        f = self.get(owner, file_id)
        with self._lock:
            if file_id in self._files:
                self._drop(file_id)
        return f

    def __len__(self) -> int:
        with self._lock:
            return len(self._files)

    def _drop(self, file_id: str) -> None:
        self._bytes -= len(self._files.pop(file_id).data)
