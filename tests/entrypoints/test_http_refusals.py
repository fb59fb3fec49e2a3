"""What the HTTP front refuses itself, before the scheduler sees it (400 bad JSON or fields, 401 a
wrong key, 404 another model, 413 a body too large), is counted in `epdserve:requests_total` by
status, under the gRPC code the gRPC API gives the same refusal; streamed requests count as ok.
And `--metrics-port` serves HTTPS when the scheduler has --tls-cert/--tls-key (flags parsed as
`epdserve scheduler` parses them, the fronts started on a real scheduler's loop)."""
from __future__ import annotations

import argparse
import asyncio
import ssl
import urllib.error
import urllib.request

import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from epdserve.entrypoints import scheduler_cli
from epdserve.entrypoints.fronts import Fronts
from tests.entrypoints.http_harness import RunningFront, metered_scheduler, post
from tests.scheduler.engine_instance import EngineInstance
from tests.security.certs import self_signed

KEY = "sk-refusals"


@pytest.fixture(scope="module")
def served(qwen2_vl_tiny):
    inst = EngineInstance(qwen2_vl_tiny, "epd-r").start()
    sched, metrics = metered_scheduler(qwen2_vl_tiny, [inst])
    front = RunningFront(sched, metrics, api_key=KEY, served_model_name="tiny-vl", max_body_bytes=1 << 16)
    yield sched, front
    front.stop()
    sched.stop()
    inst.stop()


def scrape(url: str, context: ssl.SSLContext | None = None) -> dict:
    text = urllib.request.urlopen(url, timeout=30, context=context).read().decode()
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for fam in text_string_to_metric_families(text) for s in fam.samples}


def test_refused_requests_are_counted_by_status(served):
    _, front = served
    before = scrape(front.url + "/metrics")
    sent = {  # status -> how many requests the front refuses with it
        "UNAUTHENTICATED": [post(front, "/v1/completions", {"prompt": "hi"}),
                            post(front, "/v1/chat/completions", {"messages": []}, key="sk-wrong")],
        "INVALID_ARGUMENT": [post(front, "/v1/completions", None, key=KEY, raw=b"{not json"),
                             post(front, "/v1/completions", {"prompt": "hi", "top_p": 3}, key=KEY),
                             post(front, "/v1/chat/completions", {"messages": [{"role": "user", "content": [
                                 {"type": "image_url", "image_url": {"url": "ftp://x"}}]}]}, key=KEY)],
        "NOT_FOUND": [post(front, "/v1/completions", {"model": "other", "prompt": "hi"}, key=KEY)],
        "RESOURCE_EXHAUSTED": [post(front, "/v1/completions", None, key=KEY, raw=b"{" + b" " * (1 << 17) + b"}")],
    }
    http_status = {"UNAUTHENTICATED": 401, "INVALID_ARGUMENT": 400, "NOT_FOUND": 404, "RESOURCE_EXHAUSTED": 413}
    for code, answers in sent.items():
        assert [status for status, _ in answers] == [http_status[code]] * len(answers), answers
    with openai.OpenAI(base_url=front.base_url, api_key=KEY, max_retries=0, timeout=60) as oai:
        oai.completions.create(model="tiny-vl", prompt="fine", max_tokens=2)
        list(oai.completions.create(model="tiny-vl", prompt=["streamed", "twice"], max_tokens=2, stream=True))
        with pytest.raises(openai.AuthenticationError):  # /v1/models is no generation request: not counted
            openai.OpenAI(base_url=front.base_url, api_key="sk-wrong", max_retries=0).models.list()
    after = scrape(front.url + "/metrics")

    def delta(status):
        key = ("epdserve:requests_total", (("status", status),))
        return after.get(key, 0.0) - before.get(key, 0.0)

    for code, answers in sent.items():
        assert delta(code) == len(answers), code
    assert delta("ok") == 3  # one prompt, then a list of two: each prompt is a request to the scheduler
    assert delta("CANCELLED") == 0


def test_metrics_port_serves_https_with_the_tls_flags(served, tmp_path):
    sched, _ = served
    cert, key = self_signed(tmp_path)
    parser = argparse.ArgumentParser()
    scheduler_cli.add_parser(parser.add_subparsers(dest="command"))
    args = parser.parse_args(["scheduler", "--model", sched.config.model, "--metrics-port", "0",
                              "--tls-cert", cert, "--tls-key", key])
    fronts = Fronts.from_args(args)
    asyncio.run_coroutine_threadsafe(fronts.start(sched.server), sched.loop).result(30)
    try:
        url = fronts.metrics_front.url + "/metrics"
        assert url.startswith("https://")
        samples = scrape(url, ssl.create_default_context(cafile=cert))
        assert ("epdserve:num_requests_running", ()) in samples
        with pytest.raises(urllib.error.URLError):  # an untrusting client cannot read it
            scrape(url, ssl.create_default_context())
        with pytest.raises((urllib.error.URLError, ConnectionError)):  # nor can plain HTTP
            scrape(url.replace("https://", "http://"))
    finally:
        asyncio.run_coroutine_threadsafe(fronts.stop(), sched.loop).result(30)
