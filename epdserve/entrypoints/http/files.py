"""/v1/files in OpenAI's Files API shape, for images (`purpose: "vision"`): encode on upload.

- ``POST /v1/files`` (multipart: ``file``, ``purpose``): the image is checked with a request's
  limits, encoded by an E instance at once (scheduler/upload_service.py) and answered as a file
  object (``status: "processed"``) whose ``id`` chat content references:
  ``{"type": "image_url", "image_url": {"url": "epdserve-file://<id>"}}`` or
  ``{"type": "file", "file": {"file_id": "<id>"}}``;
- ``GET /v1/files/{id}``: the file object; ``DELETE /v1/files/{id}``: forgets it and drops its
  features from the MM Store.
Ids belong to the uploader's tenant (`tenancy.caller_tenant`; one tenant when the server has one
key or none): another tenant's id is the same 404 as an unknown one. Only ``purpose`` "vision" (and "user_data", which OpenAI also takes
for images) is accepted; other purposes are a 400.
"""
from __future__ import annotations

from fastapi import FastAPI, Request

from epdserve.entrypoints.http import multipart
from epdserve.entrypoints.http.errors import ApiError
from epdserve.scheduler.errors import RequestError
from epdserve.entrypoints.http.tenancy import caller_tenant
from epdserve.scheduler.uploads import UploadedFile

PURPOSES = ("vision", "user_data")


def owner(request: Request) -> str:
    """Who owns the caller's uploads: its tenant (its key checked already)."""
    return caller_tenant(request)


def file_object(f: UploadedFile, purpose: str = "vision") -> dict:
    return {"id": f.file_id, "object": "file", "bytes": len(f.data), "created_at": int(f.created_at),
            "expires_at": int(f.expires_at), "filename": f.filename, "purpose": purpose, "status": "processed",
            "status_details": None if f.encoded else "not encoded yet: its first request encodes it"}


def add_routes(app: FastAPI, scheduler, check, admitted, read_body, max_body_bytes: int) -> None:
    """`check(request)`: the API key check; `admitted(coro)`: counted refusals; `read_body`:
    the front's bounded body reader."""
    uploads = scheduler.dispatcher.uploads

    def failed(e: RequestError) -> ApiError:
        return ApiError.from_grpc(e.code, e.message)

    @app.post("/v1/files")
    async def create_file(request: Request):
        async def admit():
            check(request)
            form = multipart.parse(await read_body(request, max_body_bytes), request.headers.get("content-type"))
            purpose = form.get("purpose")
            purpose = purpose.data.decode(errors="replace") if purpose is not None else ""
            if purpose not in PURPOSES:
                raise ApiError(400, f"purpose must be one of {', '.join(PURPOSES)} (this server takes images), "
                                    f"got {purpose!r}", param="purpose")
            f = form.get("file")
            if f is None or f.filename is None:
                raise ApiError(400, "the form needs a `file` part (the image file)", param="file")
            return f, purpose

        part, purpose = await admitted(admit())
        try:
            up = await uploads.upload(part.data, owner(request), part.filename or "")
        except RequestError as e:
            raise failed(e) from None
        return file_object(up, purpose)

    @app.get("/v1/files/{file_id}")
    async def get_file(file_id: str, request: Request):
        check(request)
        try:
            return file_object(uploads.get(owner(request), file_id))
        except RequestError as e:
            raise failed(e) from None

    @app.delete("/v1/files/{file_id}")
    async def delete_file(file_id: str, request: Request):
        check(request)
        try:
            f = await uploads.delete(owner(request), file_id)
        except RequestError as e:
            raise failed(e) from None
        return {"id": f.file_id, "object": "file", "deleted": True}
