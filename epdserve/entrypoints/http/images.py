"""`image_url` → image bytes: ``data:`` URLs always; ``http(s)://`` only when the operator allowed
remote images, fetched in a worker thread by the SSRF-guarded `remote_media.fetch_remote` (checked
addresses and redirects, `--allowed-media-domains`, a byte cap, one deadline for the whole fetch).
Anything else is the request's fault: `ApiError` 400, naming the image and where it came from
(`source`). Every failed fetch reads the same (`CANNOT_FETCH`), whatever the cause — refused address,
DNS, refused or closed connection, TLS, HTTP status, timeout — so the server cannot be used as a
port scanner; only a body over the cap says so. The cause goes to the DEBUG log, never a fetched byte.
"""
from __future__ import annotations

import asyncio
import base64
import binascii
import logging

from epdserve.entrypoints.http.errors import ApiError
from epdserve.entrypoints.http.media_address import MediaDomains
from epdserve.entrypoints.http.options import HttpOptions
from epdserve.entrypoints.http.remote_media import FetchFailed, FetchPolicy, TooLarge, fetch_remote

log = logging.getLogger(__name__)

CANNOT_FETCH = "cannot fetch the image"


def source(url: str) -> str:
    """Where a media URL points, for error messages: "image/jpeg data URL", "URL https://host/a.png"."""
    if url.startswith("data:"):
        mime = url[5:].partition(",")[0].partition(";")[0]
        return f"{mime or 'untyped'} data URL"
    return f"URL {url if len(url) <= 80 else url[:77] + '...'}"


def decode_data_url(url: str, limit: int, name: str = "the image") -> bytes:
    """The bytes of a base64 data: URL; `name` says which item in errors."""
    head, sep, payload = url.partition(",")
    if not sep or not head.startswith("data:"):
        raise ApiError(400, f"{name}: a data: URL needs the form data:<mime>;base64,<data>")
    if not head.endswith(";base64"):
        raise ApiError(400, f"{name}: only base64 data: URLs are supported")
    if len(payload) * 3 // 4 > limit:
        raise ApiError(413, f"{name} is larger than {limit} bytes")
    try:
        return base64.b64decode(payload, validate=True)
    except (binascii.Error, ValueError):
        raise ApiError(400, f"{name}: the data: URL is not valid base64") from None


async def fetch(url: str, opts: HttpOptions, name: str = "the image") -> bytes:
    """GET `url` in a worker thread (the fetcher's own deadline ends its sockets; the wait here also
    bounds a DNS lookup that hangs); `name` says which image in errors."""
    policy = FetchPolicy(MediaDomains(opts.allowed_media_domains), opts.max_image_bytes, opts.image_fetch_timeout_s)
    loop = asyncio.get_running_loop()
    try:
        return await asyncio.wait_for(loop.run_in_executor(None, fetch_remote, url, policy), opts.image_fetch_timeout_s)
    except TooLarge as e:
        log.debug("%s: %s", name, e.reason)
        raise ApiError(400, f"{name} is larger than {opts.max_image_bytes} bytes (--max-image-bytes)") from None
    except Exception as e:  # noqa: BLE001 - every cause reads the same to the client
        log.debug("%s: %s: %s", name, CANNOT_FETCH, _cause(e, opts.image_fetch_timeout_s))
        raise ApiError(400, f"{name}: {CANNOT_FETCH}") from None


def _cause(e: BaseException, timeout_s: float) -> str:
    """Why a fetch failed, for the DEBUG log: the fetcher's reason (no fetched bytes in it), or the type."""
    if isinstance(e, FetchFailed):
        return e.reason
    if isinstance(e, asyncio.TimeoutError):
        return f"the fetch took longer than {timeout_s} s"
    return type(e).__name__


async def image_bytes(url: str, opts: HttpOptions, name: str = "the image") -> bytes:
    """The bytes `url` names; `name` says which image in errors ("image 2 (URL ..., messages[0]...)")."""
    if url.startswith("data:"):
        return decode_data_url(url, opts.max_image_bytes, name)
    if url.startswith(("http://", "https://")):
        if not opts.allow_remote_images:
            raise ApiError(400, f"{name}: http(s) image URLs are disabled on this server (start it with "
                                "--allow-remote-images); send a data: URL")
        return await fetch(url, opts, name)
    raise ApiError(400, f"{name}: image_url must be a data: URL (or http(s) when the server allows it)")
