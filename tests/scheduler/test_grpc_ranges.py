"""The gRPC front's range checks, from the client's side of a real scheduler in front of a real
engine instance: every number of SamplingParams and every token id of a GenerateRequest out of
its range (`epdserve.rpc.ranges`) is INVALID_ARGUMENT naming the field, through `epdserve.Client`
and through a raw stub sending bytes no well-behaved client builds (varints past int32, which the
server's parser truncates); nothing is logged at ERROR; the scheduler serves the next request."""
from __future__ import annotations

import logging
import math

import grpc
import pytest
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

from epdserve import Client
from epdserve.client import EPDServeError
from epdserve.rpc import SERVE_SERVICE, common_pb2, serve_pb2
from tests.scheduler.engine_instance import EngineInstance
from tests.scheduler.harness import start_scheduler

VOCAB = 2000  # the tiny demo model's


@pytest.fixture(scope="module")
def served(qwen2_vl_tiny):
    inst = EngineInstance(qwen2_vl_tiny, "epd-g").start()
    sched = start_scheduler(qwen2_vl_tiny, [inst])
    with Client(sched.address, timeout=60, retries=0) as client:
        yield sched, client
    sched.stop()
    inst.stop()


def still_serves(client) -> None:
    out = client.generate("still fine", max_tokens=2, ignore_eos=True)
    assert out.finish_reason == "length" and len(out.token_ids) == 2


CASES = [  # (generate's keywords, the field the refusal names)
    ({"max_tokens": 0}, "sampling.max_tokens"),
    ({"max_tokens": -(2**31)}, "sampling.max_tokens"),
    ({"top_k": -1}, "sampling.top_k"),
    ({"temperature": -1.0}, "sampling.temperature"),
    ({"temperature": math.nan}, "sampling.temperature"),
    ({"temperature": math.inf}, "sampling.temperature"),
    ({"top_p": 0.0}, "sampling.top_p"),
    ({"top_p": math.nan}, "sampling.top_p"),
    ({"top_p": 1.5}, "sampling.top_p"),
    ({"min_p": -0.5}, "sampling.min_p"),
    ({"min_p": math.inf}, "sampling.min_p"),
    ({"stop_token_ids": [3, -1]}, "sampling.stop_token_ids[1]"),
    ({"prompt": [1, 2, -5]}, "prompt_token_ids[2]"),
    ({"prompt": [VOCAB]}, "prompt_token_ids[0]"),
    ({"prompt": [2**31 - 1]}, "prompt_token_ids[0]"),
]


@pytest.mark.parametrize("kw, field", CASES, ids=[f"{f}={kw}"[:60] for kw, f in CASES])
def test_out_of_range_is_invalid_argument_naming_the_field(served, caplog, kw, field):
    _, client = served
    kw = dict(kw)
    prompt = kw.pop("prompt", "a range test")
    with caplog.at_level(logging.ERROR), pytest.raises(EPDServeError) as e:
        client.generate(prompt, max_tokens=kw.pop("max_tokens", 2), **kw)
    assert e.value.code == grpc.StatusCode.INVALID_ARGUMENT and e.value.details.startswith(f"{field} must be "), \
        e.value.details
    assert [r for r in caplog.records if r.levelno >= logging.ERROR] == []
    still_serves(client)


def test_the_messages_say_the_range(served):
    _, client = served
    with pytest.raises(EPDServeError) as top_k:
        client.generate("x", max_tokens=2, top_k=-3)
    with pytest.raises(EPDServeError) as prompt:
        client.generate([7, 4000], max_tokens=2)
    assert top_k.value.details == "sampling.top_k must be an integer in [0, 2147483647] (0 turns it off), got -3"
    assert prompt.value.details == ("prompt_token_ids[1] must be a token id in [0, 2000) (the model's vocabulary), "
                                    "got 4000")


def test_resume_token_ids_out_of_the_vocabulary(served):
    sched, _ = served
    req = serve_pb2.GenerateRequest(prompt="hi", resume_token_ids=[1, VOCAB + 7],
                                    sampling=common_pb2.SamplingParams(max_tokens=8))
    with grpc.insecure_channel(sched.address) as ch:
        with pytest.raises(grpc.RpcError) as e:
            ch.unary_unary(f"/{SERVE_SERVICE}/Generate", request_serializer=lambda m: m.SerializeToString(),
                           response_deserializer=serve_pb2.GenerateResponse.FromString)(req, timeout=60)
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert e.value.details().startswith("resume_token_ids[1] must be a token id in [0, 2000)"), e.value.details()


def _varint(n: int) -> bytes:
    out = bytearray()
    while True:
        byte, n = n & 0x7F, n >> 7
        out.append(byte | (0x80 if n else 0))
        if not n:
            return bytes(out)


def _wire(sampling_field: str, value: int) -> bytes:
    """A GenerateRequest ("hi", max_tokens 2) whose SamplingParams `sampling_field` carries `value`
    as a raw varint, however many bits it has: what a hostile client can put on the wire."""
    number = common_pb2.SamplingParams.DESCRIPTOR.fields_by_name[sampling_field].number
    sampling = common_pb2.SamplingParams(max_tokens=2).SerializeToString() + _varint(number << 3) + _varint(value)
    at = serve_pb2.GenerateRequest.DESCRIPTOR.fields_by_name["sampling"].number
    head = serve_pb2.GenerateRequest(prompt="hi").SerializeToString()
    return head + _varint(at << 3 | 2) + _varint(len(sampling)) + sampling


def _raw_generate(address: str, data: bytes):
    with grpc.insecure_channel(address) as ch:
        return ch.unary_unary(f"/{SERVE_SERVICE}/Generate", request_serializer=None,
                              response_deserializer=serve_pb2.GenerateResponse.FromString)(data, timeout=60)


@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(field=st.sampled_from(["max_tokens", "top_k"]), value=st.integers(min_value=2**31, max_value=2**64 - 1))
def test_raw_varints_past_int32_are_refused_or_served_never_internal(served, field, value):
    """The parser keeps an int32 field's low 32 bits: a value that lands out of range is refused
    naming the field; one that lands in range is an ordinary request. Never INTERNAL."""
    sched, _ = served
    landed = (value & 0xFFFFFFFF) - (1 << 32 if value & 0x80000000 else 0)
    assume(field != "max_tokens" or landed <= 4)  # in range but long: keep the examples quick
    ok = landed >= (1 if field == "max_tokens" else 0)
    try:
        out = _raw_generate(sched.address, _wire(field, value))
    except grpc.RpcError as e:
        assert not ok and e.code() == grpc.StatusCode.INVALID_ARGUMENT, (e.code(), e.details())
        assert e.details().startswith(f"sampling.{field} must be ") and f"got {landed}" in e.details(), e.details()
    else:
        assert ok and out.finish_reason in ("length", "stop"), out


@pytest.mark.parametrize("field, value, landed", [("max_tokens", 2**40, 0), ("top_k", 2**32 - 1, -1),
                                                  ("max_tokens", 2**64 - 5, -5)])
def test_raw_varint_examples(served, field, value, landed):
    sched, client = served
    with pytest.raises(grpc.RpcError) as e:
        _raw_generate(sched.address, _wire(field, value))
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT and f"sampling.{field}" in e.value.details()
    assert e.value.details().endswith(f"got {landed}"), e.value.details()
    still_serves(client)
