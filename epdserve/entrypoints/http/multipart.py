"""multipart/form-data bodies (RFC 7578), as OpenAI's clients send POST /v1/files: fields by name.

A body already read (bounded by the front's `max_body_bytes`) is split at its boundary; each part's
Content-Disposition gives its field name and filename. Anything malformed is a 400 (`ApiError`)
saying what is wrong. The standard library only: no parser dependency for one route.
"""
from __future__ import annotations

from dataclasses import dataclass
from email.message import Message

from epdserve.entrypoints.http.errors import ApiError


@dataclass
class Field:
    name: str
    data: bytes
    filename: str | None = None  # set for a file part
    content_type: str = ""


def _params(header: str, value: str) -> Message:
    m = Message()
    m[header] = value
    return m


def parse(body: bytes, content_type: str | None) -> dict[str, Field]:
    """The form's fields by name (the first of a repeated name)."""
    ct = _params("content-type", content_type or "")
    if ct.get_content_type() != "multipart/form-data":
        raise ApiError(400, "the body must be multipart/form-data (fields `file` and `purpose`)")
    boundary = ct.get_param("boundary")
    if not isinstance(boundary, str) or not boundary:
        raise ApiError(400, "multipart/form-data without a boundary")
    delim = b"--" + boundary.encode("latin-1")
    chunks = body.split(delim)
    if len(chunks) < 3 or not chunks[-1].startswith(b"--"):
        raise ApiError(400, "malformed multipart/form-data body (no closing boundary)")
    fields: dict[str, Field] = {}
    for chunk in chunks[1:-1]:
        head, sep, data = chunk.removeprefix(b"\r\n").partition(b"\r\n\r\n")
        if not sep:
            raise ApiError(400, "malformed multipart/form-data part (no blank line after its headers)")
        headers = {}
        for line in head.decode("latin-1").split("\r\n"):
            name, colon, value = line.partition(":")
            if colon:
                headers[name.strip().lower()] = value.strip()
        disp = _params("content-disposition", headers.get("content-disposition", ""))
        name = disp.get_param("name", header="content-disposition")
        if not isinstance(name, str):
            raise ApiError(400, "a multipart/form-data part has no field name")
        filename = disp.get_filename()
        fields.setdefault(name, Field(name, data.removesuffix(b"\r\n"), filename, headers.get("content-type", "")))
    return fields
