"""Every number of a completions or chat body has a range, from the attacker's side of the real HTTP
front in front of a real scheduler and engine instance: integers past what the gRPC message holds
(max_tokens >= 2^31, seed >= 2^63, top_k >= 2^32, token ids over int32), negatives, NaN and
Infinity, token ids over the model's vocabulary are each a 400 whose JSON body names the field,
counted as INVALID_ARGUMENT, with no traceback in the log, and the server serves the next request.
Every other error body is JSON too: no such route (404), wrong method (405), a body over the limit
(413), and an unexpected exception (a 500 whose traceback is logged once)."""
from __future__ import annotations

import asyncio
import http.client
import json
import logging
import math

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from epdserve.entrypoints.http import HttpFront, HttpOptions
from epdserve.entrypoints.http.convert import sampling
from epdserve.entrypoints.http.errors import ApiError
from epdserve.entrypoints.http.protocol import CompletionRequest
from tests.entrypoints.http_harness import post, served_front
from tests.entrypoints.test_http_errors import counted, grew
from tests.metrics.test_refusal_counts import http_responses

CHAT, COMPLETIONS = "/v1/chat/completions", "/v1/completions"
MESSAGES = [{"role": "user", "content": "hi"}]
NAN, INF = math.nan, math.inf  # json.dumps writes them as NaN / Infinity, which JSON parsers take


@pytest.fixture(scope="module")
def served(qwen2_vl_tiny):
    yield from served_front(qwen2_vl_tiny, "epd-r", served_model_name="tiny-vl")


class _Kept(logging.Handler):
    def __init__(self):
        super().__init__(logging.ERROR)
        self.records: list[logging.LogRecord] = []

    def emit(self, record):
        self.records.append(record)


@pytest.fixture
def tracebacks():
    """ERROR records with a traceback, from the app's loggers and uvicorn's (which do not propagate
    to the root logger)."""
    kept = _Kept()
    loggers = [logging.getLogger(), logging.getLogger("uvicorn")]
    for lg in loggers:
        lg.addHandler(kept)
    yield lambda: [r for r in kept.records if r.exc_info]
    for lg in loggers:
        lg.removeHandler(kept)


def body_for(path: str, **fields) -> dict:
    base = {"messages": MESSAGES} if path == CHAT else {"prompt": "hi"}
    return {**base, "max_tokens": 2, **fields}


def refused(front, path: str, body: dict) -> dict:
    """POST `body`; assert a JSON 400 in OpenAI's shape; its error object."""
    status, answer = post(front, path, body)
    assert status == 400 and isinstance(answer, dict), (status, answer)  # str: the body was not JSON
    err = answer["error"]
    assert err["type"] == "BadRequestError" and err["code"] == 400, err
    return err


def still_serves(front) -> None:
    status, answer = post(front, COMPLETIONS, {"prompt": "still fine", "max_tokens": 2, "ignore_eos": True})
    assert status == 200 and answer["choices"][0]["finish_reason"] == "length", answer


OUT_OF_RANGE = [  # (path, field, value, the param the 400 names)
    (CHAT, "max_tokens", 2**31, "max_tokens"),
    (CHAT, "max_tokens", 0, "max_tokens"),
    (COMPLETIONS, "max_tokens", -1, "max_tokens"),
    (CHAT, "max_completion_tokens", 2**31, "max_completion_tokens"),
    (CHAT, "seed", 2**63, "seed"),
    (COMPLETIONS, "seed", -(2**63) - 1, "seed"),
    (CHAT, "top_k", 2**32, "top_k"),
    (COMPLETIONS, "top_k", 2**31, "top_k"),
    (COMPLETIONS, "top_k", -2, "top_k"),
    (CHAT, "temperature", -0.5, "temperature"),
    (CHAT, "temperature", NAN, "temperature"),
    (COMPLETIONS, "temperature", INF, "temperature"),
    (COMPLETIONS, "top_p", 0, "top_p"),
    (COMPLETIONS, "top_p", 1.5, "top_p"),
    (CHAT, "top_p", NAN, "top_p"),
    (COMPLETIONS, "min_p", -0.1, "min_p"),
    (COMPLETIONS, "min_p", NAN, "min_p"),
    (CHAT, "n", 0, "n"),
    (COMPLETIONS, "n", 2**70, "n"),
    (COMPLETIONS, "best_of", 2**70, "best_of"),
    (COMPLETIONS, "logprobs", 2**70, "logprobs"),
    (COMPLETIONS, "logprobs", -1, "logprobs"),
    (CHAT, "logprobs", 5, "logprobs"),  # chat's is a bool
    (CHAT, "top_logprobs", 2**70, "top_logprobs"),
    (CHAT, "presence_penalty", 3, "presence_penalty"),
    (COMPLETIONS, "presence_penalty", NAN, "presence_penalty"),
    (CHAT, "frequency_penalty", -INF, "frequency_penalty"),
    (COMPLETIONS, "repetition_penalty", 0, "repetition_penalty"),
    (COMPLETIONS, "repetition_penalty", NAN, "repetition_penalty"),
    (CHAT, "stop_token_ids", [2**31], "stop_token_ids[0]"),
    (COMPLETIONS, "stop_token_ids", [1, -1], "stop_token_ids[1]"),
    (COMPLETIONS, "stop_token_ids", [2**63], "stop_token_ids[0]"),
    (COMPLETIONS, "prompt", [2**31], "prompt[0]"),
    (COMPLETIONS, "prompt", [5, -1], "prompt[1]"),
    (COMPLETIONS, "prompt", [[1], [1, 2**40]], "prompt[1][1]"),
    (COMPLETIONS, "prompt", [10**6], "prompt[0]"),  # over the tiny model's vocabulary (2000)
    (COMPLETIONS, "prompt", [[1], [1, 2000]], "prompt[1][1]"),
    (COMPLETIONS, "logit_bias", {str(2**31): 1}, f"logit_bias.{2**31}"),
    (CHAT, "logit_bias", {"5": 101}, "logit_bias.5"),
    (CHAT, "logit_bias", {"5": NAN}, "logit_bias.5"),
    # in range, but what epdserve does not do: refused by the field's name
    (COMPLETIONS, "best_of", 2, "best_of"),  # best_of other than n
    (CHAT, "top_logprobs", 2, "top_logprobs"),  # without logprobs=true
]


@pytest.mark.parametrize("path, field, value, param", OUT_OF_RANGE,
                         ids=[f"{p.rsplit('/', 1)[1]}-{f}={v!r}"[:60] for p, f, v, _ in OUT_OF_RANGE])
def test_a_number_out_of_range_is_a_json_400_naming_it(served, tracebacks, path, field, value, param):
    _, front = served
    before = counted(front)
    err = refused(front, path, body_for(path, **{field: value}))
    assert err["param"] == param and err["message"].startswith(param), err
    assert grew(before, counted(front)) == {"INVALID_ARGUMENT": 1}
    still_serves(front)
    assert tracebacks() == []


def test_the_vocabulary_bound_says_what_it_is(served):
    _, front = served
    err = refused(front, COMPLETIONS, body_for(COMPLETIONS, prompt=[3, 10**6]))
    assert err["message"] == "prompt[1] must be a token id in [0, 2000) (the model's vocabulary), got 1000000", err


@pytest.mark.parametrize("max_tokens, message", [
    (2**40, "a sampling parameter is out of range: Value out of range: 1099511627776"),  # protobuf's refusal
    (-5, "max_tokens must be an integer in [1, 2147483647], got -5"),  # the shared rules
])
def test_what_pydantic_let_through_is_still_a_400(max_tokens, message):
    """The front checks what it built too: a body its models never bounded (built unvalidated here,
    as a future field without bounds would be) is still a 400, never a 500."""
    body = CompletionRequest.model_construct(prompt="hi", max_tokens=max_tokens)
    with pytest.raises(ApiError) as e:
        sampling(body, max_model_len=64, max_tokens=body.max_tokens)
    assert e.value.status == 400 and e.value.message == message, e.value.message


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(field=st.sampled_from(["max_tokens", "seed", "top_k", "n", "best_of", "logprobs", "top_logprobs",
                              "stop_token_ids", "prompt"]),
       value=st.one_of(st.integers(min_value=2**63), st.integers(max_value=-(2**63) - 1)),
       chat=st.booleans())
def test_integers_far_out_of_range_are_always_400_naming_the_field(served, field, value, chat):
    _, front = served
    path = CHAT if chat and field not in ("prompt", "best_of", "logprobs") else COMPLETIONS
    listed = field in ("stop_token_ids", "prompt")
    err = refused(front, path, body_for(path, **{field: [value] if listed else value}))
    assert err["param"] == (f"{field}[0]" if listed else field), err


class BrokenHealth:
    """The started `SchedulerServer`, except that its registry fails when /health reads it: an
    exception no route guards, injected at the front's one dependency (no real input reaches one)."""

    class _Registry:
        def records(self):
            raise RuntimeError("<epdserve.scheduler.Registry object at 0xdeadbeef> is broken")

    def __init__(self, server):
        self._server = server
        self.registry = self._Registry()

    def __getattr__(self, name):
        return getattr(self._server, name)


@pytest.fixture(scope="module")
def broken(served):
    sched, _ = served
    front = HttpFront(BrokenHealth(sched.server), HttpOptions(max_body_bytes=1024), sched.server.observer)
    asyncio.run_coroutine_threadsafe(front.start(), sched.loop).result(30)
    yield front
    asyncio.run_coroutine_threadsafe(front.stop(), sched.loop).result(30)


def _raw(front: HttpFront, method: str, path: str, headers=None) -> tuple[int, dict, str]:
    host, port = front.address.rsplit(":", 1)
    conn = http.client.HTTPConnection(host, int(port), timeout=60)
    conn.request(method, path, headers=headers or {})
    resp = conn.getresponse()
    text = resp.read().decode()
    conn.close()
    return resp.status, dict(resp.getheaders()), text


def test_every_error_body_is_json_and_an_unexpected_one_is_logged_once(served, broken, tracebacks):
    _, served_front = served
    front = served_front.front
    before = http_responses(served_front)  # the broken front counts in the same registry
    answers = {
        404: _raw(front, "GET", "/v1/nothing-here"),
        405: _raw(front, "DELETE", "/v1/completions"),
        413: _raw(broken, "POST", "/v1/completions", {"Content-Length": str(10**12), "Content-Type": "application/json"}),
        500: _raw(broken, "GET", "/health"),
    }
    for status, (got, headers, text) in answers.items():
        assert got == status and headers["content-type"] == "application/json", (status, got, text)
        err = json.loads(text)["error"]
        assert err["code"] == status and "Traceback" not in text and "0x" not in text, err
    assert json.loads(answers[404][2])["error"]["message"].startswith("no route GET /v1/nothing-here; this server "
                                                                      "serves /v1/chat/completions, /v1/completions")
    assert answers[405][1]["allow"] == "POST"
    assert json.loads(answers[500][2])["error"]["type"] == "InternalServerError"
    still_serves(served_front)  # the server logs an exception it saw after answering: by now, it has
    logged = tracebacks()
    assert len(logged) == 1 and "RuntimeError" in repr(logged[0].exc_info[1]), logged  # once: not again by uvicorn
    assert grew(before, http_responses(served_front)) == {
        ("unmatched", "404"): 1, ("/v1/completions", "405"): 1, ("/v1/completions", "413"): 1, ("/health", "500"): 1,
        ("/v1/completions", "200"): 1}
