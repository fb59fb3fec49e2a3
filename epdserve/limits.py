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
dispatcher does, for every front) and returns the pixels its media declare: every image's
width x height and, for a video, every frame the decoder will hold (`video_header`: frame
count, or duration x rate, and frame size, from the container's header; `model.video` decodes
the whole clip before it samples frames). Their sum is bounded by `max_request_pixels`; the
dispatcher also counts it against the scheduler's pixels in flight. `add_limit_args(parser)` /
`limits_from_args(args)` give every front the same flags.
"""
from __future__ import annotations

import argparse
import io
import math
import warnings
from dataclasses import dataclass, fields

import grpc


@dataclass(frozen=True)
class InputLimits:
    max_message_bytes: int = 64 << 20  # one request as received (every image and text in it)
    max_images: int = 16  # images in one request
    # width x height one image declares (before it is decoded): a 24 MP camera photo (6000x4000) fits; the
    # models' image processors keep at most 12.8 MP (Qwen2/2.5-VL) or 16.8 MP (Qwen3-VL) of it anyway
    max_image_pixels: int = 25_000_000
    # all the images' pixels + every decoded video frame's, in one request (3 bytes each as RGB, several times
    # that at the scheduler's peak while an image is preprocessed: docs/measurements.md):
    # four 24 MP photos, or 16 1080p screenshots, or 10 s of 480p video at 30 fps
    max_request_pixels: int = 100_000_000
    max_prompt_bytes: int = 1 << 20  # UTF-8 bytes of all prompt / chat text, before tokenisation
    max_prompt_token_ids: int = 1 << 20  # a prompt sent as token ids
    max_chat_messages: int = 1024
    max_stop: int = 64  # stop strings + stop token ids
    # a structured output's text (JSON schema, regex, grammar, or its choices together): compiling costs
    # time and memory that grow with it (a 290 KB, 20,000-value enum: 1.8 s and ~62 MB compiled here); OpenAI's
    # Structured Outputs docs bound a schema's names and enum values at 120,000 characters and 1,000 enum values
    # ("Supported schemas", as https://jsonschemaprofiles.unitvectorylabs.com/schemas/openai records them)
    max_structured_output_bytes: int = 256 << 10

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
    """`texts`: every text of the request (a prompt; each chat text part; its stop strings, which
    the stop checker matches against every token's text as much as a prompt costs). Counted in
    UTF-8 bytes."""
    total = 0
    for t in texts:
        total += len(t.encode("utf-8", "surrogatepass")) if isinstance(t, str) else len(t)
        if total > limits.max_prompt_bytes:
            raise LimitError("max_prompt_bytes", f"prompt text and stop strings are over the limit of "
                                                 f"{limits.max_prompt_bytes} bytes")


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


def check_structured_output(structured, limits: InputLimits) -> None:
    """A request's `StructuredOutput` (its constraint's text) within `max_structured_output_bytes`."""
    kind = structured.WhichOneof("constraint")
    if kind in ("json_schema", "regex", "grammar"):
        n = len(getattr(structured, kind).encode())
    elif kind == "choice":
        n = sum(len(c.encode()) for c in structured.choice.choices)
    else:
        return
    if n > limits.max_structured_output_bytes:
        raise LimitError("max_structured_output_bytes",
                         f"the structured output's {kind} is {n} bytes, over the limit of "
                         f"{limits.max_structured_output_bytes} (--max-structured-output-bytes)")


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
                                             f"{limits.max_image_pixels} per image; send a smaller image, or raise "
                                             f"the server's --max-image-pixels")
    return w, h


def check_generate_request(req, limits: InputLimits) -> int:
    """Every limit, on an `epdserve.v1.GenerateRequest` (what each front builds): sizes first,
    then counts, then each image's header, then the pixels of all its media together. Raises
    LimitError; returns the pixels its media declare (media sent by key: none, nothing is decoded)."""
    check_message_bytes(req.ByteSize(), limits)
    sp = req.sampling
    check_stop(len(sp.stop) + len(sp.stop_token_ids), limits)
    if sp.HasField("structured"):
        check_structured_output(sp.structured, limits)
    kind = req.WhichOneof("input")
    media = [(m, _is_video(m)) for m in req.media]  # (Media, is a video)
    stops = list(sp.stop)  # in the prompt's byte budget
    if kind == "prompt":
        check_prompt_bytes([req.prompt, *stops], limits)
    elif kind == "prompt_token_ids":
        check_prompt_token_ids(len(req.prompt_token_ids.ids), limits)
        check_prompt_bytes(stops, limits)
    elif kind == "chat":
        check_chat_messages(len(req.chat.messages), limits)
        texts = []
        for msg in req.chat.messages:
            texts.append(msg.role)
            for part in msg.content:
                which = part.WhichOneof("part")
                if which == "text":
                    texts.append(part.text)
                elif which == "image":
                    media.append((part.image, _is_video(part.image)))
                elif which == "video":  # a video part is a video, its sampling options or not
                    media.append((part.video, True))
        check_prompt_bytes(texts + stops, limits)
    else:
        check_prompt_bytes(stops, limits)
    pictures = [m for m, video in media if not video]  # videos have limits of their own (VideoSpec)
    check_image_count(len(pictures), limits)
    images = [check_image(m.data, limits, index=n) for n, m in enumerate(pictures, 1)
              if m.WhichOneof("source") == "data"]  # n: the image's number among the request's images, from 1
    videos = [video_header(m.data) for m, video in media if video and m.WhichOneof("source") == "data"]
    return check_request_pixels([w * h for w, h in filter(None, images)],
                                [t * w * h for t, w, h in filter(None, videos)], limits)


def check_request_pixels(images: list[int], videos: list[int], limits: InputLimits) -> int:
    """The pixels of one request's `images` and `videos` (each video: all its decoded frames)
    together, against `max_request_pixels`. Returns their sum."""
    total = sum(images) + sum(videos)
    if total > limits.max_request_pixels:
        raise LimitError("max_request_pixels",
                         f"the request's media declare {total} pixels in all ({len(images)} image(s): {sum(images)}, "
                         f"{len(videos)} video(s): {sum(videos)} in their decoded frames), over the limit of "
                         f"{limits.max_request_pixels} per request; send fewer or smaller media, or raise the "
                         f"server's --max-request-pixels")
    return total


def video_header(data: bytes) -> tuple[int, int, int] | None:
    """(frames, width, height) that a video's container header declares — the frames the decoder
    will hold: its frame count, else its duration x frame rate (24 fps when none is declared), else
    the decoder's cap (`model.video.MAX_DECODED_FRAMES`). Nothing is decoded. None when PyAV cannot
    open the bytes or finds no video stream (the decoder later refuses them with its own clear error)."""
    import av

    from epdserve.model.video import MAX_DECODED_FRAMES

    try:
        with av.open(io.BytesIO(data)) as container:
            if not container.streams.video:
                return None
            stream = container.streams.video[0]
            w, h = int(stream.codec_context.width), int(stream.codec_context.height)
            frames = int(stream.frames or 0)
            if frames <= 0:
                rate = float(stream.average_rate or 0) or 24.0
                if stream.duration and stream.time_base:
                    seconds = float(stream.duration * stream.time_base)
                elif container.duration:
                    seconds = container.duration / av.time_base
                else:
                    seconds = MAX_DECODED_FRAMES / rate
                frames = math.ceil(seconds * rate)
    except Exception:  # not a container PyAV knows, or a truncated header
        return None
    return min(max(frames, 0), MAX_DECODED_FRAMES), w, h


def _is_video(media) -> bool:
    return "video" in media.DESCRIPTOR.fields_by_name and media.HasField("video")


# ------------------------------------------------------------------ command-line flags, shared by the fronts
_FLAGS = {  # field -> (flag, help)
    "max_message_bytes": ("--max-message-bytes", "largest request accepted, in bytes (RESOURCE_EXHAUSTED beyond)"),
    "max_images": ("--max-images", "images per request"),
    "max_image_pixels": ("--max-image-pixels", "width x height one image may declare (checked before decoding; a "
                         "24 MP photo fits, the models' image processors keep at most 12.8-16.8 MP of it)"),
    "max_request_pixels": ("--max-request-pixels", "pixels of all of one request's images plus every frame of its "
                           "videos that the decoder holds (the whole clip: frames x width x height), as their headers "
                           "declare, checked before decoding; each costs 3 bytes as RGB, ~14 at the scheduler's peak "
                           "while an image is preprocessed (measured), and again at the encoding instance: four 24 MP "
                           "photos, sixteen 1080p images or 10 s of 480p video at 30 fps fit"),
    "max_prompt_bytes": ("--max-prompt-bytes", "UTF-8 bytes of a request's prompt / chat text (before tokenisation)"),
    "max_prompt_token_ids": ("--max-prompt-token-ids", "length of a prompt sent as token ids"),
    "max_chat_messages": ("--max-chat-messages", "messages in one chat"),
    "max_stop": ("--max-stop", "stop strings + stop token ids of one request"),
    "max_structured_output_bytes": ("--max-structured-output-bytes",
                                    "UTF-8 bytes of a structured output's JSON schema, regex, grammar or choices "
                                    "(compiling one costs time and memory that grow with it)"),
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
