"""Instance-side metrics on the scheduler's /metrics (through GetLoad / heartbeats): an in-process
E-P-D deployment (three `InstanceHost`s registering with a real scheduler, a real MM Store, a
real gloo KV pair), scraped with prometheus_client's parser. After a request P's sent KV bytes
equal D's received ones and the prompt's blocks (every layer's K and V), with no failure; every
instance reports engine steps, their time and batch sizes, and its decode graphs (none on the CPU:
D's decode steps counted as eager); the KV blocks D holds are back."""
from __future__ import annotations

import asyncio
import urllib.request

import pytest
from prometheus_client.parser import text_string_to_metric_families

from epdserve import Client
from epdserve.entrypoints.http import MetricsFront
from epdserve.instance.config import InstanceConfig
from epdserve.instance.host import InstanceHost
from epdserve.transfer.mm_store.server import LocalRedisServer
from tests.entrypoints.http_harness import metered_scheduler
from tests.instance.harness import PH, image, wait_until


@pytest.fixture(scope="module")
def deployment(qwen2_vl_tiny):
    store = LocalRedisServer().start()
    sched, metrics = metered_scheduler(qwen2_vl_tiny, heartbeat_interval_s=0.2)
    hosts = {}
    front = MetricsFront(metrics, "127.0.0.1", 0)
    try:
        for roles in ("E", "P", "D"):
            hosts[roles] = InstanceHost(InstanceConfig(
                roles=roles, model=str(qwen2_vl_tiny), scheduler=sched.server.internal_address, mm_store=store.url,
                instance_id=f"{roles.lower()}0", kv_cache_bytes=4 << 20, feature_wait_s=10.0)).start()
        wait_until(lambda: len(sched.call(sched.server.registry.records)) == 3, 120, "three instances to register")
        asyncio.run_coroutine_threadsafe(front.start(), sched.loop).result(30)
        yield sched, hosts, front
    finally:
        asyncio.run_coroutine_threadsafe(front.stop(), sched.loop).result(30)
        for h in hosts.values():
            h.stop()
        sched.stop()
        store.stop()


def fresh_heartbeats(sched, instance_ids) -> None:
    registry = sched.server.registry
    since = sched.call(registry.clock)
    wait_until(lambda: all(sched.call(lambda: registry.get(i).last_heartbeat) > since for i in instance_ids), 30,
               "heartbeats")


def scrape(url: str) -> dict:
    text = urllib.request.urlopen(url, timeout=30).read().decode()
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for fam in text_string_to_metric_families(text) for s in fam.samples}


def _get(samples, name, **labels):
    return samples.get((name, tuple(sorted(labels.items()))))


def test_kv_transfer_and_engine_step_metrics(deployment):
    sched, hosts, front = deployment
    url = front.url + "/metrics"
    sent = dict(instance="p0", roles="P", direction="sent")
    received = dict(instance="d0", roles="D", direction="received")
    before = scrape(url)
    assert _get(before, "epdserve:instance_kv_transfer_bytes_total", **sent) == 0
    with Client(sched.address, timeout=120) as c:
        r = c.generate(f"Describe {PH}", images=[image(5)], max_tokens=4, ignore_eos=True)
    spec = hosts["P"].workers[0].engine.kv_cache.spec
    expected = -(-r.usage.prompt_tokens // spec.block_size) * spec.bytes_per_block()

    for _ in range(2):  # the figures come with heartbeats: wait for two sent after the request ended
        fresh_heartbeats(sched, ("p0", "d0", "e0"))
    after = scrape(url)
    assert _get(after, "epdserve:instance_kv_transfer_bytes_total", **sent) == expected > 0
    assert _get(after, "epdserve:instance_kv_transfer_bytes_total", **received) == expected
    assert _get(after, "epdserve:instance_kv_transfer_failures_total", **sent) == 0
    assert _get(after, "epdserve:instance_vision_seconds_total", instance="e0", roles="E") > 0  # it encoded the image
    assert _get(after, "epdserve:instance_vision_seconds_total", instance="d0", roles="D") == 0
    assert _get(after, "epdserve:instance_kv_transfer_failures_total", **received) == 0
    assert _get(after, "epdserve:instance_kv_transfer_bytes_total", instance="e0", roles="E", direction="sent") is None
    for iid, roles in (("p0", "P"), ("d0", "D")):
        steps = _get(after, "epdserve:instance_engine_step_seconds_count", instance=iid, roles=roles)
        assert steps >= 1 and _get(after, "epdserve:instance_engine_step_seconds_sum", instance=iid, roles=roles) > 0
        assert _get(after, "epdserve:instance_engine_step_batch_size_count", instance=iid, roles=roles) == steps
        assert _get(after, "epdserve:instance_engine_step_batch_size_sum", instance=iid, roles=roles) >= steps
    # D ran the 3 decode steps after P's first token, one request each
    assert _get(after, "epdserve:instance_engine_step_batch_size_sum", instance="d0", roles="D") == 3
    assert _get(after, "epdserve:instance_kv_blocks_used", instance="d0", roles="D") == 0  # freed at the end
    # decode graphs (issue 52 item 3): none on the CPU, so D's 3 decode steps ran eagerly
    d0 = dict(instance="d0", roles="D")
    assert _get(after, "epdserve:instance_eager_decode_steps_total", **d0) == 3
    assert _get(after, "epdserve:instance_decode_graph_replays_total", **d0) == 0
    assert _get(after, "epdserve:instance_decode_graphs", **d0) == 0
