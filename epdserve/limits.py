"""Input limits of one request, checked before any work is spent on it (any front: gRPC, HTTP).

`InputLimits` is the set of bounds (a frozen dataclass; its defaults are the servers'). The
`check_*` functions look only at sizes and image headers — no tokenisation, no image decode —
and raise `LimitError`, which says the status a front answers with: `grpc_code`
(INVALID_ARGUMENT for what no retry can fix, RESOURCE_EXHAUSTED for a message over the size
bound, as gRPC itself reports one) and `http_status` (400 / 413).

    limits = InputLimits(max_images=4)
    check_message_bytes(len(body), limits)
    check_prompt_bytes([text], limits)         # every text of the request: prompt, chat parts
    check_image_count(len(images), limits)
    for n, data in enumerate(images, 1):
        check_image(data, limits, index=n)     # the pixels its header declares ("image n", from 1)

`check_generate_request(req, limits)` applies them all to a `GenerateRequest` (the scheduler's
dispatcher does, for every front). `add_limit_args(parser)` / `limits_from_args(args)` give
every front the same flags.
"""
from __future__ import annotations

import argparse
import io
import warnings
from dataclasses import dataclass, fields

import grpc


@dataclass(frozen=True)
class InputLimits:
    max_message_bytes: int = 64 << 20  # one request as received (every image and text in it)
    max_images: int = 16  # images in one request
    max_image_pixels: int = 40_000_000  # width x height one image declares (before it is decoded)
    max_prompt_bytes: int = 1 << 20  # UTF-8 bytes of all prompt / chat text, before tokenisation
    max_prompt_token_ids: int = 1 << 20  # a prompt sent as token ids
    max_chat_messages: int = 1024
    max_stop: int = 64  # stop strings + stop token ids

    def __post_init__(self):
        for f in fields(self):
            if int(getattr(self, f.name)) < 1:
                raise ValueError(f"{f.name} must be >= 1")


class LimitError(ValueError):
    """A request over one of the `InputLimits`. `limit`: the field it broke."""

    def __init__(self, limit: str, message: str, exhausted: bool = False):
        super().__init__(message)
        self.limit = limit
        self.message = message
        self.exhausted = exhausted

    @property
    def grpc_code(self) -> grpc.StatusCode:
        return grpc.StatusCode.RESOURCE_EXHAUSTED if self.exhausted else grpc.StatusCode.INVALID_ARGUMENT

    @property
    def http_status(self) -> int:
        return 413 if self.exhausted else 400


def check_message_bytes(n: int, limits: InputLimits) -> None:
    if n > limits.max_message_bytes:
        raise LimitError("max_message_bytes", f"request of {n} bytes is over the limit of {limits.max_message_bytes}",
                         exhausted=True)


def check_prompt_bytes(texts, limits: InputLimits) -> None:
    """`texts`: every text of the request (a prompt; each chat text part). Counted in UTF-8 bytes."""
    total = 0
    for t in texts:
        total += len(t.encode("utf-8", "surrogatepass")) if isinstance(t, str) else len(t)
        if total > limits.max_prompt_bytes:
            raise LimitError("max_prompt_bytes", f"prompt text is over the limit of {limits.max_prompt_bytes} bytes")


def check_prompt_token_ids(n: int, limits: InputLimits) -> None:
    if n > limits.max_prompt_token_ids:
        raise LimitError("max_prompt_token_ids",
                         f"{n} prompt token ids are over the limit of {limits.max_prompt_token_ids}")


def check_image_count(n: int, limits: InputLimits) -> None:
    if n > limits.max_images:
        raise LimitError("max_images", f"{n} images are over the limit of {limits.max_images} per request")


def check_chat_messages(n: int, limits: InputLimits) -> None:
    if n > limits.max_chat_messages:
        raise LimitError("max_chat_messages", f"{n} chat messages are over the limit of {limits.max_chat_messages}")


def check_stop(n: int, limits: InputLimits) -> None:
    if n > limits.max_stop:
        raise LimitError("max_stop", f"{n} stop strings / token ids are over the limit of {limits.max_stop}")


def check_image(data: bytes, limits: InputLimits, index: int = 1) -> tuple[int, int] | None:
    """Check the dimensions one encoded image declares (PIL reads only the header here; nothing is
    decoded; its bytes count towards `max_message_bytes`); `index`: the image's number in errors
    (from 1, as the decoder's errors count). Returns (width, height), or None when PIL cannot
    identify the bytes (the decoder later refuses them with its own clear error)."""
    from PIL import Image

    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # DecompressionBombWarning: our own bound decides
            with Image.open(io.BytesIO(data)) as im:
                w, h = im.size
    except Image.DecompressionBombError:
        raise LimitError("max_image_pixels", f"image {index}: declares more pixels than PIL will decode") from None
    except Exception:  # not an image PIL knows, or a truncated header
        return None
    if w * h > limits.max_image_pixels:
        raise LimitError("max_image_pixels", f"image {index}: {w}x{h} = {w * h} pixels are over the limit of "
                                             f"{limits.max_image_pixels}")
    return w, h


def check_generate_request(req, limits: InputLimits) -> None:
    """Every limit, on an `epdserve.v1.GenerateRequest` (what each front builds): sizes first,
    then counts, then each image's header. Raises LimitError."""
    check_message_bytes(req.ByteSize(), limits)
    sp = req.sampling
    check_stop(len(sp.stop) + len(sp.stop_token_ids), limits)
    kind = req.WhichOneof("input")
    pictures = [m for m in req.media if not _is_video(m)]  # videos have limits of their own (VideoSpec)
    images = [(n, m.data) for n, m in enumerate(pictures, 1) if m.WhichOneof("source") == "data"]
    n_images = len(pictures)
    if kind == "prompt":
        check_prompt_bytes([req.prompt], limits)
    elif kind == "prompt_token_ids":
        check_prompt_token_ids(len(req.prompt_token_ids.ids), limits)
    elif kind == "chat":
        check_chat_messages(len(req.chat.messages), limits)
        texts = []
        for msg in req.chat.messages:
            texts.append(msg.role)
            for part in msg.content:
                which = part.WhichOneof("part")
                if which == "text":
                    texts.append(part.text)
                elif which == "image" and not _is_video(part.image):
                    n_images += 1
                    if part.image.WhichOneof("source") == "data":
                        images.append((n_images, part.image.data))
        check_prompt_bytes(texts, limits)
    check_image_count(n_images, limits)
    for n, data in images:  # n: the image's number among the request's images, from 1
        check_image(data, limits, index=n)


def _is_video(media) -> bool:
    return "video" in media.DESCRIPTOR.fields_by_name and media.HasField("video")


# ------------------------------------------------------------------ command-line flags, shared by the fronts
_FLAGS = {  # field -> (flag, help)
    "max_message_bytes": ("--max-message-bytes", "largest request accepted, in bytes (RESOURCE_EXHAUSTED beyond)"),
    "max_images": ("--max-images", "images per request"),
    "max_image_pixels": ("--max-image-pixels", "width x height one image may declare (checked before decoding)"),
    "max_prompt_bytes": ("--max-prompt-bytes", "UTF-8 bytes of a request's prompt / chat text (before tokenisation)"),
    "max_prompt_token_ids": ("--max-prompt-token-ids", "length of a prompt sent as token ids"),
    "max_chat_messages": ("--max-chat-messages", "messages in one chat"),
    "max_stop": ("--max-stop", "stop strings + stop token ids of one request"),
}


def add_limit_args(p: argparse.ArgumentParser) -> None:
    """Add one flag per `InputLimits` field (INVALID_ARGUMENT beyond each, unless said otherwise)."""
    g = p.add_argument_group("input limits", "checked before any work on a request")
    defaults = InputLimits()
    for name, (flag, text) in _FLAGS.items():
        g.add_argument(flag, dest=f"limit_{name}", type=int, metavar="N", default=getattr(defaults, name),
                       help=f"{text} (default {getattr(defaults, name)})")


def limits_from_args(a: argparse.Namespace) -> InputLimits:
    return InputLimits(**{name: getattr(a, f"limit_{name}") for name in _FLAGS})
