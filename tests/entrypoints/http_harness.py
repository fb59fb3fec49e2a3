"""Test harness for the HTTP front: an `HttpFront` started on a `SchedulerThread`'s own loop (as
`epdserve scheduler --http-port` runs it), plus raw-HTTP helpers (stdlib http.client)."""
from __future__ import annotations

import asyncio
import base64
import http.client
import json
from contextlib import contextmanager

from epdserve.entrypoints.http import HttpFront, HttpOptions
from epdserve.metrics import ServingMetrics
from epdserve.scheduler import SchedulerConfig, SchedulerThread
from tests.scheduler.harness import wait_until


def metered_scheduler(model_dir, instances=(), **overrides) -> tuple[SchedulerThread, ServingMetrics]:
    """`tests.scheduler.harness.start_scheduler` with the Prometheus metrics observing it."""
    cfg = dict(model=str(model_dir), static_instances=[i.address for i in instances], probe_interval_s=0.1,
               probe_timeout_s=1.0, retry_backoff_s=0.01)
    cfg.update(overrides)
    metrics = ServingMetrics()
    sched = SchedulerThread(SchedulerConfig(**cfg), observer=metrics)
    sched.start()
    metrics.attach(sched.server)
    want = {i.instance_id for i in instances}
    wait_until(lambda: want <= {r.instance_id for r in sched.call(sched.server.registry.records)},
               what="instances to join")
    return sched, metrics


@contextmanager
def metered_deployment(model_dir, instances, served_model_name: str = "tiny-vl"):
    """A metered scheduler, in-process `InstanceHost`s for `instances` ((instance id, roles) each;
    4 MiB of KV cache) and an HTTP front: yields (scheduler, front); stops all of it after."""
    from epdserve.instance.config import InstanceConfig
    from epdserve.instance.host import InstanceHost

    sched, metrics = metered_scheduler(model_dir, heartbeat_interval_s=0.2)
    hosts, front = [], None
    try:
        for iid, roles in instances:
            hosts.append(InstanceHost(InstanceConfig(
                roles=roles, model=str(model_dir), scheduler=sched.server.internal_address,
                instance_id=iid, kv_cache_bytes=4 << 20)).start())
        wait_until(lambda: len(sched.call(sched.server.registry.records)) == len(hosts), 120, "instances to register")
        front = RunningFront(sched, metrics, served_model_name=served_model_name)
        yield sched, front
    finally:
        if front is not None:
            front.stop()
        for h in hosts:
            h.stop()
        sched.stop()


class RunningFront:
    def __init__(self, sched, metrics=None, **opts):
        self.sched = sched
        self.front = HttpFront(sched.server, HttpOptions(**opts), metrics)
        asyncio.run_coroutine_threadsafe(self.front.start(), sched.loop).result(30)

    @property
    def url(self) -> str:
        return self.front.url

    @property
    def base_url(self) -> str:
        return self.front.url + "/v1"

    def stop(self) -> None:
        asyncio.run_coroutine_threadsafe(self.front.stop(), self.sched.loop).result(30)


def data_url(jpeg: bytes) -> str:
    return "data:image/jpeg;base64," + base64.b64encode(jpeg).decode()


def connect(front: RunningFront, timeout: float = 60.0) -> http.client.HTTPConnection:
    host, port = front.front.address.rsplit(":", 1)
    return http.client.HTTPConnection(host, int(port), timeout=timeout)


def post(front: RunningFront, path: str, body, key: str | None = None, raw: bytes | None = None):
    """POST `body` (JSON) and return (status, parsed JSON or text)."""
    conn = connect(front)
    headers = {"Content-Type": "application/json"}
    if key:
        headers["Authorization"] = f"Bearer {key}"
    conn.request("POST", path, body=raw if raw is not None else json.dumps(body), headers=headers)
    resp = conn.getresponse()
    data = resp.read().decode()
    conn.close()
    try:
        return resp.status, json.loads(data)
    except ValueError:
        return resp.status, data


def served_front(model_dir, instance_id: str, **front):
    """A generator for a module fixture: (scheduler, front) over one real engine instance, all
    stopped after; `front`: RunningFront options."""
    from tests.scheduler.engine_instance import EngineInstance

    inst = EngineInstance(model_dir, instance_id).start()
    sched, metrics = metered_scheduler(model_dir, [inst])
    running = RunningFront(sched, metrics, **front)
    yield sched, running
    running.stop()
    sched.stop()
    inst.stop()
