"""Errors a request can fail with because of what it asked for (they map to INVALID_ARGUMENT /
HTTP 400), and how a library's exception reads to the user who sent the input.

`InvalidRequestError`: the request itself is bad. `MediaError`: one media item is bad; its text is
``<subject> <what>`` ("image 2 is not a readable image (12 bytes): ..."), and `naming` gives the
same error about a named item (callers that know which item it was, and where it came from, say
so: "image 2 (image/jpeg data URL)"; images and videos are counted from 1, each kind apart).
`readable(exc)`: a third-party exception (PIL, PyAV, transformers) as a short text with no Python
object repr (``<_io.BytesIO object at 0x…>``), no errno noise and nothing of the input itself: a
bytes repr a decoder quoted (``chunk b'\\x00\\x01...'``) becomes ``<bytes>``, any character that is not
printable ASCII ``?``, and the text stops at `MAX_READABLE` characters (a server answering an image URL
with binary bytes must not get them into an error text or the log).

Imports nothing of epdserve: every layer raises or maps these (rpc/ranges.py, model/, the
engine, instance/, scheduler/, the fronts).
"""
from __future__ import annotations

import re


class InvalidRequestError(ValueError):
    """The request itself is bad (corrupt media, placeholder mismatch, too long, bad params)."""


class MediaError(InvalidRequestError):
    """One media item is bad: `subject` names it ("the image", "image 2 (image/png data URL)"),
    `what` says what is wrong with it ("is not a readable image (12 bytes): ...")."""

    def __init__(self, what: str, subject: str = "the image"):
        super().__init__(f"{subject} {what}")
        self.what = what
        self.subject = subject

    def naming(self, subject: str) -> MediaError:
        return MediaError(self.what, subject)


_REPR = re.compile(r"""['"]?<[\w.]+ object at 0x[0-9a-fA-F]+>['"]?""")
_ERRNO = re.compile(r"^\[Errno -?\d+\]\s*")
_NO_NAME = re.compile(r""":?\s*['"]<none>['"]""")  # PyAV's file name for an in-memory file
_BYTES = re.compile(r"""\bb(['"])(?:\\.|(?!\1).)*\1""")  # a bytes repr: what the input held
MAX_READABLE = 200


def readable(exc: BaseException) -> str:
    """`exc` as a user reads it: what went wrong, without object reprs or errno prefixes."""
    if type(exc).__name__ == "UnidentifiedImageError":  # PIL: "cannot identify image file <_io.BytesIO ...>"
        return "not in an image format the server reads (JPEG, PNG, WebP, GIF, BMP, TIFF, ...)"
    text = _BYTES.sub("<bytes>", _NO_NAME.sub("", _ERRNO.sub("", _REPR.sub("", str(exc)))))
    text = "".join(c if (c.isascii() and c.isprintable()) or c.isspace() else "?" for c in text)
    text = re.sub(r"\s+", " ", text).strip(" :,;")
    if len(text) > MAX_READABLE:
        text = text[:MAX_READABLE - 3] + "..."
    return text or type(exc).__name__
