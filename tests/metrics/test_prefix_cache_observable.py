"""The KV prefix cache seen from outside (issue 28 item 5), in-process deployments of real
`InstanceHost`s registering with a real scheduler that serves the OpenAI API: monolithic (one EPD
instance) and P-D (P encodes inline and prefills, D decodes over a real gloo KV pair). Two chats
sharing an image and a long prefix: the second's `usage.prompt_tokens_details.cached_tokens`
(official `openai` client) is > 0, whole blocks of the prefilling instance's cache, and equals the
gRPC API's `usage.cached_tokens` for the same chat over another image; the prefilling instance's
`epdserve:instance_prefix_cache_{queries,hits}_total` move by the prompts' tokens and the cached
ones; `GetServerInfo` gives the hit rate per instance and overall."""
from __future__ import annotations

import asyncio
import urllib.request

import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from epdserve import Client
from tests.entrypoints.http_harness import data_url, metered_deployment
from tests.instance.harness import image, wait_until

LONG = "You are a careful assistant who describes pictures in plain words for the user. " * 3
MODES = {"monolithic": (("epd0", "EPD"),), "P-D": (("p0", "P+E"), ("d0", "D"))}


@pytest.fixture(scope="module", params=sorted(MODES))
def deployment(request, qwen2_vl_tiny):
    with metered_deployment(qwen2_vl_tiny, MODES[request.param]) as (sched, front):
        yield sched, front, MODES[request.param][0][0]


def _scrape(url: str) -> dict:
    text = urllib.request.urlopen(url, timeout=30).read().decode()
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for fam in text_string_to_metric_families(text) for s in fam.samples}


def _fresh_heartbeats(sched) -> None:
    registry = sched.server.registry
    for _ in range(2):  # figures come with heartbeats: two sent after the requests ended
        since = sched.call(registry.clock)
        wait_until(lambda: all(r.last_heartbeat > since for r in sched.call(registry.records)), 30, "heartbeats")


def _chat(img: bytes, turns: list[str]) -> list[dict]:
    """A conversation whose first user turn holds `img` after the long system prompt."""
    msgs = [{"role": "system", "content": LONG}]
    for i, t in enumerate(turns):
        content = [{"type": "image_url", "image_url": {"url": data_url(img)}}] if i == 0 else []
        msgs.append({"role": "user", "content": [*content, {"type": "text", "text": t}]})
        if i < len(turns) - 1:
            msgs.append({"role": "assistant", "content": "It is a picture."})
    return msgs


def _as_grpc(msgs: list[dict], img: bytes) -> list[dict]:
    out = []
    for m in msgs:
        if isinstance(m["content"], str):
            out.append(m)
            continue
        parts = [{"type": "image", "image": img} if p["type"] == "image_url" else p for p in m["content"]]
        out.append({"role": m["role"], "content": parts})
    return out


def test_cached_tokens_counters_and_hit_rate(deployment):
    sched, front, prefiller = deployment
    img, other = image(11), image(12)  # the same size: as many vision tokens
    greedy = dict(temperature=0, max_tokens=4, extra_body={"ignore_eos": True})
    with openai.OpenAI(base_url=front.base_url, api_key="none", max_retries=0, timeout=120) as oai:
        first = oai.chat.completions.create(model="tiny-vl", messages=_chat(img, ["What is it?"]), **greedy)
        second = oai.chat.completions.create(
            model="tiny-vl", messages=_chat(img, ["What is it?", "And its colours?"]), **greedy)
    assert first.usage.prompt_tokens_details.cached_tokens == 0  # nothing cached yet
    cached = second.usage.prompt_tokens_details.cached_tokens
    assert 0 < cached < second.usage.prompt_tokens and cached % 16 == 0  # whole blocks of the shared prefix
    assert cached >= 16 * (first.usage.prompt_tokens // 16) - 16  # the first turn's prefix, image included

    # the same two turns over gRPC with another image: the system prompt before it is shared, the
    # rest not, until its own second turn reuses its first as much as HTTP's did
    with Client(sched.address, timeout=120) as c:
        g1 = c.chat(_as_grpc(_chat(other, ["What is it?"]), other), max_tokens=4, ignore_eos=True)
        g2 = c.chat(_as_grpc(_chat(other, ["What is it?", "And its colours?"]), other), max_tokens=4,
                    ignore_eos=True)
        assert g2.usage.prompt_tokens == second.usage.prompt_tokens
        assert 0 < g1.usage.cached_tokens < cached  # the text before the image only
        assert g2.usage.cached_tokens == cached
        _fresh_heartbeats(sched)
        info = c.server_info()

    samples = _scrape(front.url + "/metrics")
    queries = {dict(k[1])["instance"]: (dict(k[1])["roles"], v) for k, v in samples.items()
               if k[0] == "epdserve:instance_prefix_cache_queries_total"}
    roles, queried = queries[prefiller]
    prompts = 2 * (first.usage.prompt_tokens + second.usage.prompt_tokens)
    assert queried == prompts  # every prompt looked up once, where it was prefilled
    hits = samples[("epdserve:instance_prefix_cache_hits_total", (("instance", prefiller), ("roles", roles)))]
    assert hits == 2 * cached + g1.usage.cached_tokens
    assert all(v == 0 for iid, (_, v) in queries.items() if iid != prefiller)  # D prefills nothing

    per = {i.instance_id: i.load for i in info.instances}
    assert per[prefiller].prefix_queried_tokens == prompts and per[prefiller].prefix_hit_tokens == hits
    assert per[prefiller].prefix_cache_hit_rate == pytest.approx(hits / prompts)
    assert info.prefix_cache_hit_rate == pytest.approx(hits / prompts) and 0 < info.prefix_cache_hit_rate < 1
