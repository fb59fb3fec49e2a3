"""`image_url` → image bytes: ``data:`` URLs always; ``http(s)://`` only when the operator allowed
remote images, fetched (urllib, in a worker thread) with a byte cap and a time limit. Anything
else, or a fetch that fails, is the request's fault: `ApiError` 400, naming the image and where it
came from (`source`), a failed fetch by its reason ("Connection refused", "HTTP 404 Not Found")."""
from __future__ import annotations

import asyncio
import base64
import binascii
import urllib.error
import urllib.request

from epdserve.entrypoints.http.errors import ApiError
from epdserve.entrypoints.http.options import HttpOptions
from epdserve.model.errors import readable


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


def _get(url: str, opts: HttpOptions) -> bytes:
    req = urllib.request.Request(url, headers={"User-Agent": "epdserve"})
    with urllib.request.urlopen(req, timeout=opts.image_fetch_timeout_s) as resp:
        data = resp.read(opts.max_image_bytes + 1)
    if len(data) > opts.max_image_bytes:
        raise ApiError(400, f"the image at the URL is larger than {opts.max_image_bytes} bytes")
    return data


async def fetch(url: str, opts: HttpOptions) -> bytes:
    """GET `url` in a worker thread: each socket wait and the whole fetch bounded by the timeout."""
    loop = asyncio.get_running_loop()
    try:
        return await asyncio.wait_for(loop.run_in_executor(None, _get, url, opts), opts.image_fetch_timeout_s)
    except asyncio.TimeoutError:
        raise ApiError(400, f"fetching the image took longer than {opts.image_fetch_timeout_s} s") from None
    except (OSError, ValueError) as e:  # URLError, HTTPError, socket errors
        raise ApiError(400, f"cannot fetch the image: {_why(e)}") from None


def _why(e: BaseException) -> str:
    """A failed fetch in words: "HTTP 404 Not Found", "Connection refused" (urllib's str() of a
    URLError is "<urlopen error ...>")."""
    if isinstance(e, urllib.error.HTTPError):
        return f"HTTP {e.code} {e.reason}"
    reason = getattr(e, "reason", None)
    if isinstance(reason, BaseException):
        return readable(reason)
    return reason if isinstance(reason, str) and reason else readable(e)


async def image_bytes(url: str, opts: HttpOptions, name: str = "the image") -> bytes:
    """The bytes `url` names; `name` says which image in errors ("image 2 (URL ..., messages[0]...)")."""
    if url.startswith("data:"):
        return decode_data_url(url, opts.max_image_bytes, name)
    if url.startswith(("http://", "https://")):
        if not opts.allow_remote_images:
            raise ApiError(400, f"{name}: http(s) image URLs are disabled on this server (start it with "
                                "--allow-remote-images); send a data: URL")
        try:
            return await fetch(url, opts)
        except ApiError as e:
            raise ApiError(e.status, f"{name}: {e.message}") from None
    raise ApiError(400, f"{name}: image_url must be a data: URL (or http(s) when the server allows it)")
