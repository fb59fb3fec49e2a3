"""Uploaded media (encode on upload): file id → the image's bytes, media key and grid, per owner.

An upload is validated and keyed like a request's image, encoded by an E instance at once (its
features land in the MM Store with the store's TTL), and kept here: the bytes, so that features
the MM Store no longer has (expired, evicted) are recomputed from them exactly by the prefilling
instance; the key and grid, so that a request referencing the file is prepared without decoding
it again. A file lives `ttl_s` seconds (or until deleted, or pushed out by its owner's own later
uploads, least recently used first); after that its id is NOT_FOUND — the bytes are gone, so
nothing could recompute its features.

Shares: the store keeps at most `max_bytes` in all, and each owner at most `tenant_max_bytes`
and `tenant_max_files` (default: the whole store, no count bound). An upload makes room only
from its own owner's files, least recently used first — never from another tenant's: a file
larger than an owner's share, or one that would need another tenant's files evicted (the store
full of theirs), is refused with RESOURCE_EXHAUSTED (HTTP 429) naming the limit. Expired files
of anyone go first (they are dead already).

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
    def __init__(self, ttl_s: float = 3600.0, max_bytes: int = 1 << 30, clock=time.time,
                 tenant_max_bytes: int | None = None, tenant_max_files: int | None = None):
        if ttl_s <= 0 or max_bytes <= 0:
            raise ValueError("ttl_s and max_bytes must be positive")
        if (tenant_max_bytes is not None and tenant_max_bytes <= 0) or (tenant_max_files is not None and tenant_max_files <= 0):
            raise ValueError("tenant_max_bytes and tenant_max_files must be positive")
        self.ttl_s, self.max_bytes, self._clock = ttl_s, max_bytes, clock
        self.tenant_max_bytes = min(tenant_max_bytes or max_bytes, max_bytes)
        self.tenant_max_files = tenant_max_files
        self._files: OrderedDict[str, UploadedFile] = OrderedDict()  # least recently used first
        self._bytes = 0
        self._owned: dict[str, list[int]] = {}  # owner -> [bytes, files]
        self._lock = threading.Lock()

    def add(self, owner: str, filename: str, data: bytes, key: str, grid_thw: list[int], num_tokens: int
            ) -> UploadedFile:
        size = len(data)
        if size > self.tenant_max_bytes:
            raise RequestError.exhausted(f"the file ({size} bytes) exceeds a tenant's upload share "
                                         f"({self.tenant_max_bytes} bytes: --upload-tenant-max-bytes, --upload-max-bytes)")
        now = self._clock()
        f = UploadedFile(f"file-{secrets.token_hex(12)}", owner, filename, data, key, list(grid_thw), num_tokens,
                         now, now + self.ttl_s)
        with self._lock:
            if self._over(owner, size):  # expired files of anyone first: they are dead already
                for fid in [fid for fid, x in self._files.items() if x.expires_at <= now]:
                    self._drop(fid)
            while self._over(owner, size):  # then the owner's own, least recently used first
                victim = self._oldest_of(owner)
                if victim is None:  # only the store's bound is left: the room is other tenants' files
                    raise RequestError.exhausted(
                        f"the upload store is full ({self.max_bytes} bytes: --upload-max-bytes) with other tenants' "
                        "files, which are never evicted for another's; retry when they expire, or lower "
                        "--upload-tenant-max-bytes so that shares fit the store")
                self._drop(victim)
            self._files[f.file_id] = f
            self._bytes += size
            held = self._owned.setdefault(owner, [0, 0])
            held[0] += size
            held[1] += 1
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

    def _over(self, owner: str, size: int) -> bool:
        """Would a file of `size` bytes put `owner`'s share or the store past a bound?"""
        held_bytes, held_files = self._owned.get(owner, (0, 0))
        return (held_bytes + size > self.tenant_max_bytes or self._bytes + size > self.max_bytes
                or (self.tenant_max_files is not None and held_files + 1 > self.tenant_max_files))

    def _oldest_of(self, owner: str) -> str | None:
        return next((fid for fid, f in self._files.items() if f.owner == owner), None)

    def _drop(self, file_id: str) -> None:
        f = self._files.pop(file_id)
        self._bytes -= len(f.data)
        held = self._owned[f.owner]
        held[0] -= len(f.data)
        held[1] -= 1
        if not held[1]:
            del self._owned[f.owner]
