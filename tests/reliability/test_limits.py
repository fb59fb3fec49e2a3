"""`epdserve.limits`: each check, its error's statuses, and the shared flags."""
from __future__ import annotations

import argparse
import struct
import zlib

import grpc
import pytest

from epdserve.limits import (InputLimits, LimitError, add_limit_args, check_generate_request, check_image,
                             check_prompt_bytes, limits_from_args)
from epdserve.rpc import common_pb2, serve_pb2
from tests.instance.harness import image


def _chunk(kind: bytes, data: bytes) -> bytes:
    return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))


def png_header(width: int, height: int) -> bytes:
    """A PNG that declares `width` x `height` with (almost) no pixel data: a few bytes that
    would decode to width * height * 3 bytes."""
    ihdr = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)
    return b"\x89PNG\r\n\x1a\n" + _chunk(b"IHDR", ihdr) + _chunk(b"IDAT", zlib.compress(b"")) + _chunk(b"IEND", b"")


def _code(fn) -> tuple[grpc.StatusCode, int, str]:
    with pytest.raises(LimitError) as e:
        fn()
    return e.value.grpc_code, e.value.http_status, e.value.limit


def test_image_dimensions_are_read_from_the_header_only():
    lim = InputLimits(max_image_pixels=10_000)
    assert check_image(image(1, 56, 56), lim) == (56, 56)
    assert _code(lambda: check_image(png_header(101, 100), lim)) == (grpc.StatusCode.INVALID_ARGUMENT, 400,
                                                                     "max_image_pixels")
    # far past PIL's own bomb bound: refused before anything is allocated
    assert _code(lambda: check_image(png_header(200_000, 200_000), InputLimits()))[2] == "max_image_pixels"
    assert check_image(b"not an image", lim) is None  # the decoder refuses it later, with its own message


def test_prompt_bytes_count_utf8_across_every_text():
    lim = InputLimits(max_prompt_bytes=10)
    check_prompt_bytes(["héllo", "abc"], lim)  # 6 + 3 bytes
    assert _code(lambda: check_prompt_bytes(["héllo", "abcde"], lim))[2] == "max_prompt_bytes"


def _chat(n_messages: int, n_images: int) -> serve_pb2.GenerateRequest:
    msgs = [serve_pb2.ChatMessage(role="user", content=[serve_pb2.ContentPart(text="hi")]) for _ in range(n_messages)]
    msgs[0].content.extend(serve_pb2.ContentPart(image=common_pb2.Media(data=image(i, 28, 28))) for i in range(n_images))
    return serve_pb2.GenerateRequest(chat=serve_pb2.Chat(messages=msgs))


def test_a_generate_request_is_checked_field_by_field():
    lim = InputLimits(max_images=2, max_chat_messages=3, max_stop=2, max_prompt_token_ids=4, max_message_bytes=20_000)
    check_generate_request(_chat(3, 2), lim)
    assert _code(lambda: check_generate_request(_chat(4, 0), lim))[2] == "max_chat_messages"
    assert _code(lambda: check_generate_request(_chat(1, 3), lim))[2] == "max_images"
    stops = serve_pb2.GenerateRequest(prompt="x", sampling=common_pb2.SamplingParams(stop=["a", "b"], stop_token_ids=[1]))
    assert _code(lambda: check_generate_request(stops, lim))[2] == "max_stop"
    ids = serve_pb2.GenerateRequest(prompt_token_ids=serve_pb2.TokenIds(ids=[1, 2, 3, 4, 5]))
    assert _code(lambda: check_generate_request(ids, lim))[2] == "max_prompt_token_ids"
    big = serve_pb2.GenerateRequest(prompt="x" * 30_000)
    assert _code(lambda: check_generate_request(big, lim)) == (grpc.StatusCode.RESOURCE_EXHAUSTED, 413,
                                                               "max_message_bytes")


def test_flags_round_trip_and_bad_limits_are_refused():
    p = argparse.ArgumentParser()
    add_limit_args(p)
    assert limits_from_args(p.parse_args([])) == InputLimits()
    assert limits_from_args(p.parse_args(["--max-images", "3"])).max_images == 3
    with pytest.raises(ValueError):
        InputLimits(max_images=0)


@pytest.mark.parametrize("t", [float("nan"), float("inf"), 1e-45, -1.0])
def test_temperatures_that_would_break_a_sampling_step_are_refused(t):
    """Found by the fuzzer: a NaN or denormal temperature made the whole engine step fail."""
    from epdserve.engine.sampling_params import SamplingParams

    with pytest.raises(ValueError, match="temperature"):
        SamplingParams(temperature=t)
    assert SamplingParams(temperature=0.0).greedy and not SamplingParams(temperature=1e-5).greedy
