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
(a previous result's `media_keys`). Every `SamplingParams` field is a keyword (max_tokens,
temperature, top_p, top_k, seed, stop, stop_token_ids, ignore_eos, skip_special_tokens).
Failures raise `EPDServeError` carrying the gRPC status code. Leaving a `generate_stream` loop
early (break, exception, close) cancels the call, which aborts the request on every instance.

This module holds the shared types and request building; `AsyncClient` lives in async_client.py.
"""
from __future__ import annotations

import dataclasses
import io
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from epdserve.engine.sampling_params import SamplingParams
from epdserve.model.chat import image_url_bytes
from epdserve.rpc import common_pb2, serve_pb2, serve_pb2_grpc

SAMPLING_FIELDS = tuple(f.name for f in dataclasses.fields(SamplingParams))
CHANNEL_OPTIONS = [("grpc.max_send_message_length", 256 << 20), ("grpc.max_receive_message_length", 256 << 20)]


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
    raise ValueError(f"unsupported content part type {kind!r}")


def chat_proto(messages: list[dict], add_generation_prompt: bool = True) -> serve_pb2.Chat:
    chat = serve_pb2.Chat(add_generation_prompt=add_generation_prompt)
    for msg in messages:
        content = msg.get("content")
        parts = [content] if isinstance(content, str) else list(content or [])
        chat.messages.append(serve_pb2.ChatMessage(role=msg["role"], content=[_part_proto(p) for p in parts]))
    return chat


def build_request(prompt=None, images=None, *, chat=None, request_id: str = "", add_generation_prompt: bool = True,
                  **sampling) -> serve_pb2.GenerateRequest:
    req = serve_pb2.GenerateRequest(request_id=request_id or "", sampling=sampling_proto(sampling))
    if chat is not None:
        if images:
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
class Client:
    def __init__(self, address: str, timeout: float | None = None):
        """address: "host:port" of the scheduler; timeout: default deadline (s) of each call."""
        self.address = address
        self.timeout = timeout
        self._channel = grpc.insecure_channel(address, options=CHANNEL_OPTIONS)
        self._stub = serve_pb2_grpc.EPDServeStub(self._channel)

    def generate(self, prompt=None, images=None, *, request_id: str = "", timeout: float | None = None,
                 **sampling) -> GenerateResult:
        req = build_request(prompt, images, request_id=request_id, **sampling)
        return result_from(self._call(self._stub.Generate, req, timeout))

    def generate_stream(self, prompt=None, images=None, *, request_id: str = "", timeout: float | None = None,
                        **sampling) -> Iterator[Delta]:
        return self._stream(build_request(prompt, images, request_id=request_id, **sampling), timeout)

    def chat(self, messages: list[dict], *, add_generation_prompt: bool = True, request_id: str = "",
             timeout: float | None = None, **sampling) -> GenerateResult:
        req = build_request(chat=messages, add_generation_prompt=add_generation_prompt, request_id=request_id,
                            **sampling)
        return result_from(self._call(self._stub.Generate, req, timeout))

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
        self._channel.close()

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
        try:
            call = self._stub.GenerateStream(req, timeout=timeout if timeout is not None else self.timeout)
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
