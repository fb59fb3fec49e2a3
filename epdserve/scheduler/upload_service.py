"""Encode on upload: the scheduler's side of `UploadMedia` / POST /v1/files (and get, delete).

Lifecycle of one upload: the bytes are checked with a request's limits (`epdserve.limits`: size,
image header, pixels) → decoded, preprocessed and keyed in a worker thread, as a request's image
(`RequestPreprocessor`; a corrupt image is INVALID_ARGUMENT) → kept in `Uploads` under a new file
id and the caller's identity → sent at once to an E instance (`Instance.Encode`, no prefill
target: the features land in the MM Store with its TTL) → answered when E answers, with the file
id. The key joins the dispatcher's stored keys, so a request referencing the file skips E and
its prefilling instance reads the features from the MM Store; the bytes travel with it, marked
`in_store`, so that features gone from the store (expired, evicted) are recomputed from them.
A failed encode (no E instance, E down) still answers with the file id (`encoded` false): the
first request that uses it encodes it, as one carrying its bytes would.
Delete forgets the file and drops its features through an E instance (`Instance.DropMedia`).
"""
from __future__ import annotations

import logging
import uuid

import grpc

from epdserve.limits import LimitError, check_generate_request
from epdserve.rpc import common_pb2, instance_pb2, serve_pb2
from epdserve.scheduler.errors import RequestError
from epdserve.scheduler.uploads import UploadedFile, Uploads
from epdserve.security.tenants import cache_salt

log = logging.getLogger(__name__)

ENCODE_TIMEOUT_S = 300.0


def to_proto(f: UploadedFile) -> serve_pb2.UploadedMedia:
    return serve_pb2.UploadedMedia(file_id=f.file_id, filename=f.filename, bytes=len(f.data), created_at=f.created_at,
                                   expires_at=f.expires_at, num_tokens=f.num_tokens, encoded=f.encoded)


class UploadService:
    def __init__(self, dispatcher, uploads: Uploads):
        self.d = dispatcher  # its config (limits), preprocessor, router, channels, stored keys, pool
        self.uploads = uploads

    async def upload(self, data: bytes, owner: str, filename: str = "") -> UploadedFile:
        d = self.d
        try:
            check_generate_request(serve_pb2.GenerateRequest(prompt="", media=[common_pb2.Media(data=data)]),
                                   d.config.limits)
        except LimitError as e:
            raise RequestError(e.grpc_code, e.message) from None
        namespace = d.registry.namespace
        if not namespace:
            raise RequestError.unavailable("no instance has reported its media namespace yet")
        prepared = await d.prep.run(owner, d.preprocessor.prepare_upload, data, namespace,
                                    cache_salt(owner, ""))  # keyed as the tenant's own requests key it
        f = self.uploads.add(owner, filename, data, prepared.key, prepared.grid_thw, prepared.num_tokens)
        f.encoded = prepared.key in d.stored or await self._encode(f)
        return f

    async def _encode(self, f: UploadedFile) -> bool:
        picked = self.d.router.encoder(f.num_tokens)
        if picked is None:
            return False
        rec, lease = picked
        ref = instance_pb2.MediaRef(key=f.key, data=f.data, grid_thw=f.grid_thw, num_tokens=f.num_tokens)
        req = instance_pb2.EncodeRequest(request_id=f"upload-{uuid.uuid4().hex}", media=[ref])
        try:
            await self.d.channels.get(rec.address).instance.Encode(req, timeout=ENCODE_TIMEOUT_S)
        except grpc.aio.AioRpcError as e:
            log.warning("encode of upload %s on %s failed (%s: %s); its first request encodes it",
                        f.file_id, rec.instance_id, e.code().name, e.details())
            if e.code() in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.UNKNOWN):
                self.d.registry.record_failure(rec.instance_id, f"encode: {e.code().name}")
            return False
        finally:
            lease.release()
        self.d.stored.add(f.key)
        return True

    def get(self, owner: str, file_id: str) -> UploadedFile:
        return self.uploads.get(owner, file_id)

    async def delete(self, owner: str, file_id: str) -> UploadedFile:
        f = self.uploads.remove(owner, file_id)
        self.d.stored.discard(f.key)
        for rec in self.d.router.encoders()[:1]:  # one E reaches the shared MM Store
            try:
                await self.d.channels.get(rec.address).instance.DropMedia(
                    instance_pb2.DropMediaRequest(keys=[f.key]), timeout=30.0)
            except grpc.aio.AioRpcError as e:
                log.warning("dropping the features of deleted upload %s on %s failed (%s); they expire with "
                            "the MM Store's TTL", file_id, rec.instance_id, e.code().name)
        return f
