"""What `Client` and `AsyncClient` send and receive: the request built from a prompt or chat
messages, images, videos and sampling keywords (`build_request`), and the results read back
(`GenerateResult`, `Delta`, `Usage`, `Timing`), with `EPDServeError` for a failed call and
`MediaKey` for media already in the MM Store, `FileId` for an upload. Imports nothing of the client package.
"""
from __future__ import annotations

import dataclasses
import io
import json
from dataclasses import dataclass, field
from pathlib import Path

import grpc

from epdserve.engine.sampling_params import SamplingParams
from epdserve.engine.structured_output import StructuredOutput
from epdserve.instance.sampling_wire import structured_to_proto
from epdserve.model.chat import image_url_bytes, unsupported_part
from epdserve.rpc import common_pb2, serve_pb2

# the keywords a generation takes: SamplingParams' fields but the scheduler's own bookkeeping and
# `n` (`Client.generate_choices` takes it: its results are n, not one)
SAMPLING_FIELDS = tuple(f.name for f in dataclasses.fields(SamplingParams) if f.name not in ("resumed_outputs", "n"))


class MediaKey(str):
    """An image referenced by its MM Store key instead of its bytes."""


FILE_URL = "epdserve-file://"  # an image_url naming an upload (the HTTP front's form too)


class FileId(str):
    """An image this caller uploaded (`Client.upload`), referenced by its file id."""


class EPDServeError(Exception):
    """A failed call: `code` is the grpc.StatusCode (INVALID_ARGUMENT, UNAVAILABLE, ...)."""

    def __init__(self, code: grpc.StatusCode, details: str):
        super().__init__(f"{code.name}: {details}")
        self.code = code
        self.details = details

    @classmethod
    def from_rpc(cls, err: grpc.RpcError) -> EPDServeError:
        return cls(err.code(), err.details() or "")


@dataclass
class Usage:
    prompt_tokens: int = 0
    prompt_text_tokens: int = 0
    vision_tokens: int = 0
    cached_vision_tokens: int = 0  # served from the MM Store, not encoded for this request
    output_tokens: int = 0
    cached_tokens: int = 0  # of prompt_tokens: KV reused from the prefilling instance's prefix cache


class Timing:
    """The request's path as the server stamped it — `StageTimings` fields (arrival, dispatched,
    encode_start/end, prefill_start, first_token, kv_transfer_end, first_decode, finished: Unix
    times, 0 = stage not run) read as attributes — and the durations between the stamps."""

    def __init__(self, stamps: common_pb2.StageTimings | None = None, **fields: float):
        self.stamps = stamps if stamps is not None else common_pb2.StageTimings(**fields)

    def __getattr__(self, name: str):
        if name == "stamps":
            raise AttributeError(name)
        return getattr(self.stamps, name)

    def __eq__(self, other) -> bool:
        return isinstance(other, Timing) and self.stamps == other.stamps

    def __repr__(self) -> str:
        fields = ", ".join(f"{f.name}={getattr(self.stamps, f.name)}" for f in self.stamps.DESCRIPTOR.fields)
        return f"Timing({fields})"

    @staticmethod
    def _span(a: float, b: float) -> float | None:
        return b - a if a and b else None

    @property
    def queue_s(self):
        return self._span(self.arrival, self.dispatched)

    @property
    def encode_s(self):
        return self._span(self.encode_start, self.encode_end)

    @property
    def e2p_s(self):
        return self._span(self.encode_end, self.prefill_start)

    @property
    def prefill_s(self):
        return self._span(self.prefill_start, self.first_token)

    @property
    def p2d_s(self):
        return self._span(self.first_token, self.kv_transfer_end)

    @property
    def first_decode_s(self):
        return self._span(self.kv_transfer_end, self.first_decode)

    @property
    def ttft_s(self):
        return self._span(self.arrival, self.first_token)

    @property
    def total_s(self):
        return self._span(self.arrival, self.finished)


@dataclass
class TokenLogprobs:
    """One output token's log probability (raw: before bias, penalties, temperature) and its most
    likely alternatives, descending."""

    logprob: float
    top_token_ids: list[int] = field(default_factory=list)
    top_logprobs: list[float] = field(default_factory=list)


@dataclass
class GenerateResult:
    request_id: str
    text: str
    token_ids: list[int]
    finish_reason: str
    usage: Usage
    timing: Timing
    media_keys: list[str] = field(default_factory=list)
    logprobs: list[TokenLogprobs] = field(default_factory=list)  # one per token, when asked (logprobs=k)


@dataclass
class Delta:
    """One stream message; `usage`, `timing`, `finish_reason` are set on the last one only."""

    request_id: str
    token_ids: list[int]
    text: str
    finished: bool = False
    finish_reason: str | None = None
    usage: Usage | None = None
    timing: Timing | None = None
    media_keys: list[str] = field(default_factory=list)
    logprobs: list[TokenLogprobs] = field(default_factory=list)
    index: int = 0  # the choice (generate_choices' n) this message belongs to


# ---------------------------------------------------------------- requests out
def sampling_proto(kwargs: dict) -> common_pb2.SamplingParams:
    unknown = sorted(set(kwargs) - set(SAMPLING_FIELDS))
    if unknown:
        raise TypeError(f"unknown sampling parameter(s) {unknown}; known: {', '.join(SAMPLING_FIELDS)}")
    p = common_pb2.SamplingParams()
    for name, value in kwargs.items():
        if value is None:
            continue
        if name == "stop":
            p.stop.extend([value] if isinstance(value, str) else list(value))
        elif name == "stop_token_ids":
            p.stop_token_ids.extend(int(t) for t in value)
        elif name == "structured":  # a StructuredOutput, or vLLM's spelling: {"json": schema}, {"regex": ...}, ...
            so = value if isinstance(value, StructuredOutput) else StructuredOutput.from_options(value)
            p.structured.CopyFrom(structured_to_proto(so))
        elif name == "logit_bias":
            p.logit_bias.update({int(t): float(b) for t, b in value.items()})
        else:
            setattr(p, name, value)
    return p


def media_proto(image) -> common_pb2.Media:
    if isinstance(image, FileId):
        return common_pb2.Media(file_id=str(image))
    if isinstance(image, MediaKey):
        return common_pb2.Media(key=str(image))
    if isinstance(image, dict) and "key" in image:
        return common_pb2.Media(key=str(image["key"]))
    if isinstance(image, (bytes, bytearray, memoryview)):
        return common_pb2.Media(data=bytes(image))
    if isinstance(image, (str, Path)):
        return common_pb2.Media(data=Path(image).read_bytes())
    if hasattr(image, "save") and hasattr(image, "size"):  # PIL.Image
        buf = io.BytesIO()
        image.save(buf, format="PNG")
        return common_pb2.Media(data=buf.getvalue())
    raise TypeError(f"an image must be bytes, a PIL image, a path or MediaKey, got {type(image).__name__}")


def _part_proto(part) -> serve_pb2.ContentPart:
    if isinstance(part, str):
        return serve_pb2.ContentPart(text=part)
    kind = part.get("type")
    if kind == "text":
        return serve_pb2.ContentPart(text=part["text"])
    if kind == "image":
        return serve_pb2.ContentPart(image=media_proto(MediaKey(part["key"]) if "key" in part else part["image"]))
    if kind == "image_url":
        url = part["image_url"]["url"] if isinstance(part.get("image_url"), dict) else part.get("image_url")
        if isinstance(url, str) and url.startswith(FILE_URL):
            return serve_pb2.ContentPart(image=common_pb2.Media(file_id=url[len(FILE_URL):]))
        return serve_pb2.ContentPart(image=common_pb2.Media(data=image_url_bytes(part["image_url"])))
    if kind == "file" and isinstance(part.get("file"), dict) and part["file"].get("file_id"):
        return serve_pb2.ContentPart(image=common_pb2.Media(file_id=part["file"]["file_id"]))  # an upload
    if kind in ("video", "video_url"):  # container bytes or a path; or a data: URL
        video = part["video"] if kind == "video" else image_url_bytes(part["video_url"], "video_url")
        return serve_pb2.ContentPart(video=video_proto(video, part.get("video_options")))
    raise ValueError(unsupported_part(kind, ("text", "image", "image_url", "file", "video", "video_url")))


def chat_proto(messages: list[dict], add_generation_prompt: bool = True) -> serve_pb2.Chat:
    chat = serve_pb2.Chat(add_generation_prompt=add_generation_prompt)
    for msg in messages:
        content = msg.get("content")
        parts = [content] if isinstance(content, str) else list(content or [])
        chat.messages.append(serve_pb2.ChatMessage(role=msg["role"], content=[_part_proto(p) for p in parts]))
    return chat


def video_proto(video, options: dict | None = None) -> common_pb2.Media:
    """A video as container bytes (mp4, webm, ...) or a path to its file, with its sampling options
    ({"fps": 2.0, "max_frames": 16, "max_pixels": ...}; unset: the model's defaults)."""
    from epdserve.rpc.video_spec import video_spec_to_proto

    if isinstance(video, (str, Path)):
        video = Path(video).read_bytes()
    if not isinstance(video, (bytes, bytearray, memoryview)):
        raise TypeError(f"a video must be container bytes or a path, got {type(video).__name__}")
    return common_pb2.Media(data=bytes(video), video=video_spec_to_proto(options))


def build_request(prompt=None, images=None, *, chat=None, request_id: str = "", add_generation_prompt: bool = True,
                  videos=None, video_options: dict | None = None, tools: list[dict] | None = None,
                  cache_salt: str = "", **sampling) -> serve_pb2.GenerateRequest:
    """`videos`: container bytes or paths, one per `<|vision_start|><|video_pad|><|vision_end|>`;
    `video_options` applies to each of them. `tools` (chat only): OpenAI tool definitions the
    prompt offers the model (its `<tool_call>` blocks: `epdserve.model.tool_calls.parse_tool_calls`).
    `cache_salt` (vLLM's): cached prefixes are shared only among requests of the caller's tenant
    with the same salt."""
    req = serve_pb2.GenerateRequest(request_id=request_id or "", sampling=sampling_proto(sampling),
                                    cache_salt=cache_salt or "")
    if chat is not None:
        if images or videos:
            raise ValueError("chat messages carry their own images")
        req.chat.CopyFrom(chat_proto(chat, add_generation_prompt))
        if tools:
            req.chat.tools_json = json.dumps(list(tools))
        return req
    if tools:
        raise ValueError("tools are offered in a chat (chat=...), not with a prompt")
    if isinstance(prompt, str):
        req.prompt = prompt
    elif prompt is not None:
        req.prompt_token_ids.ids.extend(int(t) for t in prompt)
    else:
        raise ValueError("give a prompt (text or token ids) or chat messages")
    req.media.extend(media_proto(im) for im in images or [])
    req.media.extend(video_proto(v, video_options) for v in videos or [])
    return req


# ---------------------------------------------------------------- responses in
def usage_from(p: common_pb2.Usage) -> Usage:
    return Usage(**{f.name: getattr(p, f.name) for f in dataclasses.fields(Usage)})


def timing_from(p: common_pb2.StageTimings) -> Timing:
    stamps = common_pb2.StageTimings()
    stamps.CopyFrom(p)
    return Timing(stamps)


def logprobs_from(ps) -> list[TokenLogprobs]:
    return [TokenLogprobs(p.logprob, list(p.top_token_ids), list(p.top_logprobs)) for p in ps]


def delta_from(d: serve_pb2.GenerateDelta) -> Delta:
    if not d.finished:
        return Delta(d.request_id, list(d.token_ids), d.text, logprobs=logprobs_from(d.logprobs), index=d.index)
    return Delta(d.request_id, list(d.token_ids), d.text, True, d.finish_reason, usage_from(d.usage),
                 timing_from(d.timing), list(d.media_keys), logprobs_from(d.logprobs), d.index)


def collect_choices(deltas, n: int) -> list[GenerateResult]:
    """The n `GenerateResult`s of one stream of n choices (each delta's `index`), in index order."""
    per: list[list[Delta]] = [[] for _ in range(n)]
    for d in deltas:
        per[d.index].append(d)
    return [collect(ds) for ds in per]


def collect(deltas) -> GenerateResult:
    """One `GenerateResult` from a stream's deltas (what a unary Generate would have returned)."""
    ids, text, last, lps = [], [], None, []
    for d in deltas:
        ids.extend(d.token_ids)
        text.append(d.text)
        lps.extend(d.logprobs)
        last = d
    if last is None or not last.finished:
        raise RuntimeError("the stream ended without its final message")
    return GenerateResult(last.request_id, "".join(text), ids, last.finish_reason, last.usage or Usage(),
                          last.timing or Timing(), list(last.media_keys), lps)
