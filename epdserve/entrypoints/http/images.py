"""`image_url` → image bytes: ``data:`` URLs always; ``http(s)://`` only when the operator allowed
remote images, fetched (urllib, in a worker thread) with a byte cap and a time limit. Anything
else, or a fetch that fails, is the request's fault: `ApiError` 400."""
from __future__ import annotations

import asyncio
import base64
import binascii
import urllib.request

from epdserve.entrypoints.http.errors import ApiError
from epdserve.entrypoints.http.options import HttpOptions


def decode_data_url(url: str, limit: int) -> bytes:
    head, sep, payload = url.partition(",")
    if not sep or not head.startswith("data:"):
        raise ApiError(400, "a data: URL needs the form data:<mime>;base64,<data>")
    if not head.endswith(";base64"):
        raise ApiError(400, "only base64 data: URLs are supported")
    if len(payload) * 3 // 4 > limit:
        raise ApiError(413, f"image larger than {limit} bytes")
    try:
        return base64.b64decode(payload, validate=True)
    except (binascii.Error, ValueError):
        raise ApiError(400, "the data: URL is not valid base64") from None


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
        raise ApiError(400, f"cannot fetch the image: {e}") from None


async def image_bytes(url: str, opts: HttpOptions) -> bytes:
    if url.startswith("data:"):
        return decode_data_url(url, opts.max_image_bytes)
    if url.startswith(("http://", "https://")):
        if not opts.allow_remote_images:
            raise ApiError(400, "http(s) image URLs are disabled on this server (start it with "
                                "--allow-remote-images); send a data: URL")
        return await fetch(url, opts)
    raise ApiError(400, "image_url must be a data: URL (or http(s) when the server allows it)")
