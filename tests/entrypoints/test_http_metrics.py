"""Prometheus /metrics of a scheduler, parsed with prometheus_client's own parser; its counters
checked against the requests sent (HTTP and gRPC alike), on the HTTP front and on the
standalone `MetricsFront` (`--metrics-port`)."""
import asyncio
import urllib.request

import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from epdserve import Client
from epdserve.client import EPDServeError
from epdserve.entrypoints.http import MetricsFront
from tests.entrypoints.http_harness import RunningFront, data_url, metered_scheduler
from tests.scheduler.engine_instance import EngineInstance
from tests.scheduler.harness import PH, image


@pytest.fixture(scope="module")
def deployment(qwen2_vl_tiny):
    inst = EngineInstance(qwen2_vl_tiny, "epd-m").start()
    sched, metrics = metered_scheduler(qwen2_vl_tiny, [inst])
    front = RunningFront(sched, metrics)
    yield sched, metrics, front
    front.stop()
    sched.stop()
    inst.stop()


def scrape(url: str) -> dict:
    """{(sample name, sorted labels): value} of every sample at `url`."""
    text = urllib.request.urlopen(url, timeout=30).read().decode()
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for fam in text_string_to_metric_families(text) for s in fam.samples}


def test_counters_follow_the_requests_sent(deployment):
    sched, _, front = deployment
    model = sched.config.model
    before = scrape(front.url + "/metrics")
    img = image(11)
    usages = []
    with openai.OpenAI(base_url=front.base_url, api_key="none", max_retries=0, timeout=60) as oai:
        for _ in range(2):  # the second one finds the image's features cached
            r = oai.chat.completions.create(model=model, max_tokens=5, temperature=0, extra_body={"ignore_eos": True},
                                            messages=[{"role": "user", "content": [
                                                {"type": "image_url", "image_url": {"url": data_url(img)}},
                                                {"type": "text", "text": "what?"}]}])
            usages.append((r.usage.prompt_tokens, r.usage.completion_tokens, r.usage.prompt_tokens_details.cached_tokens))
    with Client(sched.address, timeout=60) as c:
        g = c.generate("plain text", max_tokens=3, ignore_eos=True)
        usages.append((g.usage.prompt_tokens, g.usage.output_tokens, 0))
        with pytest.raises(EPDServeError):
            c.generate(f"broken {PH}", images=[b"not an image"], max_tokens=3)
    after = scrape(front.url + "/metrics")

    def delta(name, **labels):
        key = (name, tuple(sorted(labels.items())))
        return after.get(key, 0.0) - before.get(key, 0.0)

    assert delta("epdserve:request_success_total", finished_reason="length") == 3
    assert delta("epdserve:requests_total", status="ok") == 3
    assert delta("epdserve:requests_total", status="INVALID_ARGUMENT") == 1
    assert delta("epdserve:time_to_first_token_seconds_count") == 3
    assert delta("epdserve:e2e_request_latency_seconds_count") == 3
    assert delta("epdserve:time_per_output_token_seconds_count") == 3
    assert delta("epdserve:inter_token_latency_seconds_count") == 4 + 4 + 2  # tokens after the first
    assert delta("epdserve:request_stage_seconds_count", stage="queue") == 3
    assert delta("epdserve:prompt_tokens_total") == sum(u[0] for u in usages)
    assert delta("epdserve:generation_tokens_total") == 5 + 5 + 3
    cached = usages[1][2]  # the second request's prompt KV reused from the prefix cache, whole blocks
    assert cached > 0 and cached % 16 == 0
    # the same image twice: its vision tokens encoded once (miss), then served from the cache (hit)
    vision = delta("epdserve:mm_store_vision_tokens_total", result="miss")
    assert vision > 0 and delta("epdserve:mm_store_vision_tokens_total", result="hit") == vision
    assert delta("epdserve:mm_store_vision_tokens_total", result="recompute") == 0
    assert after[("epdserve:num_requests_running", ())] == 0
    assert after[("epdserve:instances", (("health", "healthy"), ("roles", "EPD")))] == 1
    assert after[("epdserve:instance_kv_blocks_total", (("instance", "epd-m"), ("roles", "EPD")))] > 0


def test_metrics_port_alone_serves_the_same_registry(deployment):
    sched, metrics, _ = deployment
    mf = MetricsFront(metrics, "127.0.0.1", 0)
    asyncio.run_coroutine_threadsafe(mf.start(), sched.loop).result(30)
    try:
        samples = scrape(mf.url + "/metrics")
        assert ("epdserve:num_requests_running", ()) in samples
        assert any(name == "epdserve:instances" for name, _ in samples)
    finally:
        asyncio.run_coroutine_threadsafe(mf.stop(), sched.loop).result(30)
