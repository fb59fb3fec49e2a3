"""Refusals are counted, from the client's side of a real scheduler whose API key comes from
EPDSERVE_API_KEY (the `epdserve scheduler` flags' own path), with its real gRPC API and HTTP
front: generation calls the API-key interceptor refuses (UNAUTHENTICATED) or grpc cannot parse
(UNKNOWN) count once in ``epdserve:requests_total``, those the request path failed count once
too (not again by the interceptor); a message over the size limit is refused by grpc-core
unseen (documented, pinned here); every HTTP response counts in
``epdserve:http_responses_total`` by route template (``unmatched`` for unknown paths) and
status."""
from __future__ import annotations

import argparse
import asyncio
import urllib.error
import urllib.request
import uuid

import grpc
import pytest
from prometheus_client.parser import text_string_to_metric_families

from epdserve import Client
from epdserve.client import EPDServeError, build_request
from epdserve.entrypoints.fronts import add_security_flags, security_from_args
from epdserve.entrypoints.http import HttpFront, HttpOptions
from epdserve.limits import InputLimits
from epdserve.metrics import ServingMetrics
from epdserve.rpc import SERVE_SERVICE, serve_pb2, serve_pb2_grpc
from epdserve.scheduler import SchedulerConfig, SchedulerThread
from epdserve.security import API_KEY_ENV, CLUSTER_TOKEN_ENV
from tests.entrypoints.http_harness import RunningFront, connect
from tests.scheduler.harness import PH, image, wait_until

KEY = "sk-refusal-count"
MAX_MESSAGE = 256 << 10
MAX_BODY = 64 << 10
GENERATE = f"/{SERVE_SERVICE}/Generate"


@pytest.fixture(autouse=True)
def _callers_have_no_key_in_env(monkeypatch):
    monkeypatch.delenv(API_KEY_ENV, raising=False)
    monkeypatch.delenv(CLUSTER_TOKEN_ENV, raising=False)


@pytest.fixture(scope="module")
def served(qwen2_vl_tiny):
    flags = argparse.ArgumentParser()
    add_security_flags(flags)
    with pytest.MonkeyPatch.context() as env:
        env.setenv(API_KEY_ENV, KEY)
        env.delenv(CLUSTER_TOKEN_ENV, raising=False)
        security = security_from_args(flags.parse_args([]))
    metrics = ServingMetrics()
    limits = InputLimits(max_message_bytes=MAX_MESSAGE, max_images=1)
    sched = SchedulerThread(SchedulerConfig(model=str(qwen2_vl_tiny), limits=limits), observer=metrics,
                            security=security)
    sched.start()
    metrics.attach(sched.server)
    front = RunningFront(sched, metrics, api_key=KEY, max_body_bytes=MAX_BODY)
    yield sched, front
    front.stop()
    sched.stop()


def scrape(front) -> list:
    text = urllib.request.urlopen(front.url + "/metrics", timeout=30).read().decode()
    return [s for fam in text_string_to_metric_families(text) for s in fam.samples]


def requests_total(front) -> dict:
    return {s.labels["status"]: s.value for s in scrape(front) if s.name == "epdserve:requests_total"}


def http_responses(front) -> dict:
    return {(s.labels["route"], s.labels["status"]): s.value for s in scrape(front)
            if s.name == "epdserve:http_responses_total" and s.labels["route"] != "/metrics"}


def grew(before: dict, after: dict) -> dict:
    return {k: after[k] - before.get(k, 0.0) for k in after if after[k] != before.get(k, 0.0)}


def settles_at(read, before: dict, want: dict) -> None:
    """`read()` grows from `before` by exactly `want` (a response is counted as its handler returns)."""
    seen = {}

    def done():
        seen["grew"] = grew(before, read())
        return seen["grew"] == want

    try:
        wait_until(done, timeout_s=5, what="the counts")
    except AssertionError:
        raise AssertionError(f"counted {seen['grew']}, expected {want}") from None


def unary_generate(address: str, request: bytes | serve_pb2.GenerateRequest, key: str | None):
    """EPDServe/Generate, unary, as any gRPC client calls it (raw bytes: an unparsable message)."""
    metadata = [("authorization", f"Bearer {key}")] if key else None
    with grpc.insecure_channel(address) as ch:
        if isinstance(request, bytes):
            return ch.unary_unary(GENERATE)(request, metadata=metadata, timeout=30)
        return serve_pb2_grpc.EPDServeStub(ch).Generate(request, metadata=metadata, timeout=30)


def test_grpc_calls_without_the_key_count_as_unauthenticated_once(served):
    sched, front = served
    before = requests_total(front)
    for key in (None, "sk-wrong"):
        with Client(sched.address, timeout=30, api_key=key) as c:
            for call in (lambda: c.generate("hi", max_tokens=2), c.model_info):  # model_info: no request
                with pytest.raises(EPDServeError) as e:
                    call()
                assert e.value.code == grpc.StatusCode.UNAUTHENTICATED
        with pytest.raises(grpc.RpcError) as u:
            unary_generate(sched.address, serve_pb2.GenerateRequest(prompt="hi"), key)
        assert u.value.code() == grpc.StatusCode.UNAUTHENTICATED
    settles_at(lambda: requests_total(front), before, {"UNAUTHENTICATED": 4})


def test_grpc_failures_on_the_request_path_count_once_and_unparsable_messages_count(served):
    sched, front = served
    before = requests_total(front)
    two = [image(1), image(2)]  # over max_images: refused by the dispatcher, on the request path
    with Client(sched.address, timeout=30, api_key=KEY) as c:
        with pytest.raises(EPDServeError) as e:  # streamed: the observer counts it, the interceptor does not
            c.generate(PH + PH, images=two, max_tokens=2)
    assert e.value.code == grpc.StatusCode.INVALID_ARGUMENT
    with pytest.raises(grpc.RpcError) as u:  # unary, likewise
        unary_generate(sched.address, build_request(PH + PH, images=two, max_tokens=2), KEY)
    assert u.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    with pytest.raises(grpc.RpcError) as bad:  # a truncated protobuf: grpc refuses it before any handler
        unary_generate(sched.address, b"\x0a\xff", KEY)
    assert bad.value.code() == grpc.StatusCode.UNKNOWN
    settles_at(lambda: requests_total(front), before, {"INVALID_ARGUMENT": 2, "UNKNOWN": 1})


def test_a_grpc_message_over_the_limit_is_refused_by_grpc_core_where_no_interceptor_sees_it(served):
    sched, front = served
    before = requests_total(front)
    with pytest.raises(grpc.RpcError) as e:
        unary_generate(sched.address, serve_pb2.GenerateRequest(prompt="x" * (MAX_MESSAGE + 1)), KEY)
    assert e.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert "larger than max" in e.value.details()
    with Client(sched.address, timeout=30, api_key=KEY) as c:  # the server goes on counting
        with pytest.raises(EPDServeError):
            c.generate(PH + PH, images=[image(1), image(2)], max_tokens=2)
    # grpc-core ends the call before any Python handler (see epdserve.metrics.refusals): only the next counts
    settles_at(lambda: requests_total(front), before, {"INVALID_ARGUMENT": 1})


def request(front, method: str, path: str, key: str | None = None, body: bytes | None = None) -> int:
    conn = connect(front)
    headers = {"Content-Type": "application/json", **({"Authorization": f"Bearer {key}"} if key else {})}
    conn.request(method, path, body=body, headers=headers)
    resp = conn.getresponse()
    resp.read()
    conn.close()
    return resp.status


def test_http_refusals_on_any_route_count_by_route_template_and_status(served):
    _, front = served
    before_requests, before = requests_total(front), http_responses(front)
    stray = [f"/v1/{uuid.uuid4().hex}", f"/{uuid.uuid4().hex}/x"]
    answered = [
        request(front, "GET", "/v1/models"),
        request(front, "GET", "/v1/models", key=KEY),
        request(front, "POST", "/v1/chat/completions", body=b'{"messages": []}'),
        *(request(front, "GET", p, key=KEY) for p in stray),
        request(front, "GET", "/v1/chat/completions", key=KEY),
        request(front, "POST", "/v1/completions", key=KEY, body=b'{"prompt": "' + b"x" * MAX_BODY + b'"}'),
        request(front, "GET", "/health"),
    ]
    assert answered == [401, 200, 401, 404, 404, 405, 413, 200]
    settles_at(lambda: http_responses(front), before, {
        ("/v1/models", "401"): 1, ("/v1/models", "200"): 1, ("/v1/chat/completions", "401"): 1,
        ("unmatched", "404"): 2, ("/v1/chat/completions", "405"): 1, ("/v1/completions", "413"): 1,
        ("/health", "200"): 1})
    routes = {route for route, _ in http_responses(front)}
    assert not any(p in route for p in stray for route in routes), routes  # no label per path sent
    # the generation requests among them, and only those, count as requests (gRPC codes)
    assert grew(before_requests, requests_total(front)) == {"UNAUTHENTICATED": 1, "RESOURCE_EXHAUSTED": 1}


class RosterLost:
    """The started `SchedulerServer`, its registry unreadable: /health fails unexpectedly (no
    real input reaches an exception there, so it is injected at the front's one dependency)."""

    def __init__(self, server):
        self._server = server

    def __getattr__(self, name):
        if name == "registry":
            raise RuntimeError("the roster went away")
        return getattr(self._server, name)


def test_an_http_500_on_a_non_generation_route_counts(served):
    sched, front = served
    broken = HttpFront(RosterLost(sched.server), HttpOptions(), sched.server.observer)
    asyncio.run_coroutine_threadsafe(broken.start(), sched.loop).result(30)
    try:
        before = http_responses(front)
        with pytest.raises(urllib.error.HTTPError) as e:
            urllib.request.urlopen(broken.url + "/health", timeout=30)
        assert e.value.code == 500 and e.value.headers["content-type"] == "application/json"
        settles_at(lambda: http_responses(front), before, {("/health", "500"): 1})
    finally:
        asyncio.run_coroutine_threadsafe(broken.stop(), sched.loop).result(30)
