"""Python client of the public `EPDServe` service: `Client` (blocking) and `AsyncClient` (asyncio).

    from epdserve import Client
    with Client("127.0.0.1:50051") as c:
        out = c.generate("Describe <|vision_start|><|image_pad|><|vision_end|>.", images=[jpeg],
                         max_tokens=32, temperature=0.0)
        print(out.text, out.usage.cached_vision_tokens, out.timing.ttft_s)
        for delta in c.generate_stream("Hello", max_tokens=8):
            print(delta.text, end="")
        c.chat([{"role": "user", "content": [{"type": "image", "image": jpeg}, {"type": "text", "text": "What?"}]}])

`prompt` follows the offline API's convention (one `<|vision_start|><|image_pad|><|vision_end|>`
per image, images in order); token ids work too (`prompt=[...]`). An image is bytes (an encoded
file), a PIL image (sent as PNG), a path, or `MediaKey(key)` for media already in the MM Store
(a previous result's `media_keys`). Chat content parts: text, `image` / `image_url`, and
`{"type": "video", "video": bytes or path, "video_options": {...}}` / `video_url` (a data: URL).
Every `SamplingParams` field is a keyword (max_tokens,
temperature, top_p, top_k, min_p, seed, stop, stop_token_ids, ignore_eos, skip_special_tokens).
Failures raise `EPDServeError` carrying the gRPC status code. Leaving a `generate_stream` loop
early (break, exception, close) cancels the call, which aborts the request on every instance.

A lost scheduler loses no request: give one address or several (`Client(["host:a", "host:b"])`,
schedulers that share the instances); a generation that fails with UNAVAILABLE is retried on
the next address, resuming after the tokens already received (resume.py: `retries`,
`retry_backoff_s`). Every call goes to the current address, which moves on at each retry.

This module holds the shared types and request building; `AsyncClient` lives in async_client.py.
"""
from __future__ import annotations

import dataclasses
import io
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from epdserve.engine.sampling_params import SamplingParams
from epdserve.entrypoints.resume import RetryPolicy, collect, resumed, retryable
from epdserve.model.chat import image_url_bytes, unsupported_part
from epdserve.rpc import common_pb2, serve_pb2, serve_pb2_grpc

SAMPLING_FIELDS = tuple(f.name for f in dataclasses.fields(SamplingParams))
CHANNEL_OPTIONS = [("grpc.max_send_message_length", 256 << 20), ("grpc.max_receive_message_length", 256 << 20),
                   # gRPC's reconnect backoff grows to 120 s by default: a restarted scheduler would wait that long
                   ("grpc.initial_reconnect_backoff_ms", 100), ("grpc.min_reconnect_backoff_ms", 100),
                   ("grpc.max_reconnect_backoff_ms", 1000)]


class MediaKey(str):
    """An image referenced by its MM Store key instead of its bytes."""


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
class GenerateResult:
    request_id: str
    text: str
    token_ids: list[int]
    finish_reason: str
    usage: Usage
    timing: Timing
    media_keys: list[str] = field(default_factory=list)


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
        else:
            setattr(p, name, value)
    return p


def media_proto(image) -> common_pb2.Media:
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
        return serve_pb2.ContentPart(image=common_pb2.Media(data=image_url_bytes(part["image_url"])))
    if kind in ("video", "video_url"):  # container bytes or a path; or a data: URL
        video = part["video"] if kind == "video" else image_url_bytes(part["video_url"], "video_url")
        return serve_pb2.ContentPart(video=video_proto(video, part.get("video_options")))
    raise ValueError(unsupported_part(kind, ("text", "image", "image_url", "video", "video_url")))


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
                  videos=None, video_options: dict | None = None, **sampling) -> serve_pb2.GenerateRequest:
    """`videos`: container bytes or paths, one per `<|vision_start|><|video_pad|><|vision_end|>`;
    `video_options` applies to each of them."""
    req = serve_pb2.GenerateRequest(request_id=request_id or "", sampling=sampling_proto(sampling))
    if chat is not None:
        if images or videos:
            raise ValueError("chat messages carry their own images")
        req.chat.CopyFrom(chat_proto(chat, add_generation_prompt))
        return req
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


def delta_from(d: serve_pb2.GenerateDelta) -> Delta:
    if not d.finished:
        return Delta(d.request_id, list(d.token_ids), d.text)
    return Delta(d.request_id, list(d.token_ids), d.text, True, d.finish_reason, usage_from(d.usage),
                 timing_from(d.timing), list(d.media_keys))


def result_from(r: serve_pb2.GenerateResponse) -> GenerateResult:
    return GenerateResult(r.request_id, r.text, list(r.token_ids), r.finish_reason, usage_from(r.usage),
                          timing_from(r.timing), list(r.media_keys))


# ---------------------------------------------------------------- the blocking client
def addresses_of(address) -> list[str]:
    """One "host:port", or several (a list, or one string with commas)."""
    out = [a.strip() for a in address.split(",")] if isinstance(address, str) else [str(a) for a in address]
    out = [a for a in out if a]
    if not out:
        raise ValueError("no scheduler address given")
    return out


class SchedulerConnection:
    """What `Client` and `AsyncClient` share: the scheduler address(es), one channel to each (made
    by `make_channel`: sync or asyncio), the retry policy and which address is current."""

    def __init__(self, address, timeout, api_key, tls_ca, tls, retries, retry_backoff_s, make_channel):
        from epdserve.security import channels

        self.addresses = addresses_of(address)
        self.timeout = timeout
        self.retry = RetryPolicy(retries, retry_backoff_s, max(retry_backoff_s, RetryPolicy.max_backoff_s))
        self.retried = 0  # generations resumed after a lost scheduler, in all
        key, token = channels.from_env(api_key)
        self._channels = [make_channel(a, CHANNEL_OPTIONS, api_key=key, cluster_token=token, tls_ca=tls_ca, tls=tls)
                          for a in self.addresses]
        self._current = 0

    @property
    def address(self) -> str:
        return self.addresses[self._current]

    @property
    def _channel(self):
        return self._channels[self._current]

    @property
    def _stub(self) -> serve_pb2_grpc.EPDServeStub:
        return serve_pb2_grpc.EPDServeStub(self._channel)


class Client(SchedulerConnection):
    def __init__(self, address, timeout: float | None = None, *, api_key: str | None = None,
                 tls_ca: str | None = None, tls: bool = False, retries: int = RetryPolicy.retries,
                 retry_backoff_s: float = RetryPolicy.backoff_s):
        """address: "host:port" of the scheduler, or a list of them (schedulers sharing the
        instances); timeout: default deadline (s) of each call (a retried generation: of all its
        attempts together). retries / retry_backoff_s: how often and after how long a generation
        that lost its scheduler is resumed (0: never). api_key: sent as ``authorization: Bearer``
        (default: EPDSERVE_API_KEY, if set); tls_ca: a PEM file of the roots to trust, for a TLS
        port (`tls=True`: TLS with the system's roots)."""
        from epdserve.security import channels

        super().__init__(address, timeout, api_key, tls_ca, tls, retries, retry_backoff_s, channels.channel)

    def generate(self, prompt=None, images=None, *, request_id: str = "", timeout: float | None = None,
                 **sampling) -> GenerateResult:
        req = build_request(prompt, images, request_id=request_id, **sampling)
        return collect(list(self._stream(req, timeout)))

    def generate_stream(self, prompt=None, images=None, *, request_id: str = "", timeout: float | None = None,
                        **sampling) -> Iterator[Delta]:
        return self._stream(build_request(prompt, images, request_id=request_id, **sampling), timeout)

    def chat(self, messages: list[dict], *, add_generation_prompt: bool = True, request_id: str = "",
             timeout: float | None = None, **sampling) -> GenerateResult:
        req = build_request(chat=messages, add_generation_prompt=add_generation_prompt, request_id=request_id,
                            **sampling)
        return collect(list(self._stream(req, timeout)))

    def chat_stream(self, messages: list[dict], *, add_generation_prompt: bool = True, request_id: str = "",
                    timeout: float | None = None, **sampling) -> Iterator[Delta]:
        req = build_request(chat=messages, add_generation_prompt=add_generation_prompt, request_id=request_id,
                            **sampling)
        return self._stream(req, timeout)

    def abort(self, request_id: str) -> bool:
        return self._call(self._stub.Abort, serve_pb2.AbortRequest(request_id=request_id), None).found

    def model_info(self) -> serve_pb2.ModelInfo:
        return self._call(self._stub.GetModelInfo, serve_pb2.GetModelInfoRequest(), None)

    def server_info(self) -> serve_pb2.ServerInfo:
        return self._call(self._stub.GetServerInfo, serve_pb2.GetServerInfoRequest(), None)

    def health(self, service: str = "") -> str:
        """The grpc.health.v1 status name ("SERVING", ...)."""
        stub = health_pb2_grpc.HealthStub(self._channel)
        resp = self._call(stub.Check, health_pb2.HealthCheckRequest(service=service), None)
        return health_pb2.HealthCheckResponse.ServingStatus.Name(resp.status)

    def wait_ready(self, timeout: float = 30.0) -> None:
        """Block until the channel connects (raises EPDServeError UNAVAILABLE after `timeout`)."""
        try:
            grpc.channel_ready_future(self._channel).result(timeout=timeout)
        except grpc.FutureTimeoutError:
            raise EPDServeError(grpc.StatusCode.UNAVAILABLE, f"{self.address} not reachable in {timeout} s") from None

    def close(self) -> None:
        for ch in self._channels:
            ch.close()

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def _call(self, method, req, timeout):
        try:
            return method(req, timeout=timeout if timeout is not None else self.timeout)
        except grpc.RpcError as e:
            raise EPDServeError.from_rpc(e) from None

    def _stream(self, req, timeout) -> Iterator[Delta]:
        """The request's deltas; on UNAVAILABLE, resumed on the next address (resume.py)."""
        timeout = timeout if timeout is not None else self.timeout
        deadline = None if timeout is None else time.monotonic() + timeout
        received: list[int] = []
        for n in range(self.retry.retries + 1):
            left = None if deadline is None else max(0.0, deadline - time.monotonic())
            try:
                for d in self._stream_once(resumed(req, received), left):
                    received.extend(d.token_ids)
                    yield d
                return
            except EPDServeError as e:
                wait = self.retry.wait_s(n + 1)
                if (not retryable(e.code) or n == self.retry.retries
                        or (deadline is not None and time.monotonic() + wait >= deadline)):
                    raise
            self._current = (self._current + 1) % len(self.addresses)
            self.retried += 1
            time.sleep(wait)  # the backoff before resuming (a scheduler restarting takes seconds)

    def _stream_once(self, req, timeout) -> Iterator[Delta]:
        try:
            call = self._stub.GenerateStream(req, timeout=timeout)
        except grpc.RpcError as e:
            raise EPDServeError.from_rpc(e) from None
        try:
            for d in call:
                yield delta_from(d)
        except grpc.RpcError as e:
            raise EPDServeError.from_rpc(e) from None
        finally:
            call.cancel()  # no-op when the stream completed; aborts the request otherwise


def __getattr__(name):
    if name == "AsyncClient":  # lazy: async_client imports this module
        from epdserve.entrypoints.async_client import AsyncClient

        return AsyncClient
    raise AttributeError(name)
