"""Test harness: a scheduler (SchedulerThread) in front of real EngineInstances, and helpers."""
from __future__ import annotations

import subprocess
import sys
from contextlib import contextmanager

from epdserve.model.demo_images import jpeg_bytes, procedural_image
from epdserve.scheduler import SchedulerConfig, SchedulerThread
from epdserve.transfer.mm_store.server import LocalRedisServer
from tests.harness import PH, wait_until  # noqa: F401 - re-exported to the package's tests


# `epdserve instance ...` without relying on the top-level CLI's command list
INSTANCE_MAIN = (
    "import argparse, logging, sys\n"
    "from epdserve.entrypoints import instance_cli\n"
    "p = argparse.ArgumentParser(); sub = p.add_subparsers(dest='command'); instance_cli.add_parser(sub)\n"
    "a = p.parse_args(['instance', *sys.argv[1:]])\n"
    "logging.basicConfig(level='WARNING')\n"
    "sys.exit(a.func(a))\n"
)


def spawn_instance(model_dir, sched: SchedulerThread, mm_store_url: str, instance_id: str, roles: str,
                   *extra: str) -> subprocess.Popen:
    """An `epdserve instance` process registering with `sched`, on the MM Store at `mm_store_url`
    (32 MiB of KV cache, no core split; `extra`: more flags), its output discarded."""
    return subprocess.Popen(
        [sys.executable, "-c", INSTANCE_MAIN, "--roles", roles, "--model", str(model_dir), "--scheduler",
         sched.server.internal_address, "--mm-store", mm_store_url, "--instance-id", instance_id, "--kv-cache-mb", "32",
         "--no-core-split", *extra], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)


def await_instances(sched: SchedulerThread, procs, n: int, timeout_s: float = 300.0) -> None:
    """Wait for `n` instance processes (`procs`) to register; fails at once when one of them died."""
    wait_until(lambda: len(sched.call(sched.server.registry.records)) == n or
               any(p.poll() is not None for p in procs), timeout_s, f"{n} instances to register")
    assert all(p.poll() is None for p in procs), "an instance process died at start"


def stop_processes(procs, grace_s: float = 30.0) -> None:
    """SIGTERM every process still running, then SIGKILL those not gone within `grace_s`."""
    for p in procs:
        if p.poll() is None:
            p.terminate()
    for p in procs:
        try:
            p.wait(grace_s)
        except subprocess.TimeoutExpired:
            p.kill()


def start_scheduler(model_dir, instances=(), observer=None, **overrides) -> SchedulerThread:
    """A scheduler thread in front of `instances`, once they have all joined. `observer`: e.g. a
    `metrics.serving.ServingMetrics`, to read what it counted (retries, requests by status)."""
    cfg = dict(model=str(model_dir), static_instances=[i.address for i in instances], probe_interval_s=0.1,
               probe_timeout_s=1.0, retry_backoff_s=0.01)
    cfg.update(overrides)
    sched = SchedulerThread(SchedulerConfig(**cfg), observer)
    sched.start()
    want = {i.instance_id for i in instances}
    wait_until(lambda: want <= {r.instance_id for r in sched.call(sched.server.registry.records)},
               what="instances to join")
    return sched


def image(i: int, w: int = 56, h: int = 56) -> bytes:
    return jpeg_bytes(procedural_image(w + 8 * (i % 3), h + 8 * (i % 2), seed=i))


def mixed_prompts(n: int) -> list[tuple[str, list[bytes]]]:
    """n prompts: every fourth text-only, the others with 1-3 images."""
    out = []
    for i in range(n):
        k = 0 if i % 4 == 0 else 1 + i % 3
        text = f"Request {i}: " + " and ".join(f"{PH}" for _ in range(k)) + (" describe." if k else " say hi.")
        out.append((text, [image(10 * i + j) for j in range(k)]))
    return out


@contextmanager
def instance_deployment(model_dir, instances, *extra: str, observer=None):
    """A real MM Store, a scheduler and one instance process per (instance id, roles) of
    `instances` (`extra`: flags for every instance), registered; yields (scheduler, {id: process},
    store) and stops them all."""
    store = LocalRedisServer().start()
    sched = start_scheduler(model_dir, [], observer=observer)
    procs = {iid: spawn_instance(model_dir, sched, store.url, iid, roles, *extra) for iid, roles in instances}
    try:
        await_instances(sched, list(procs.values()), len(procs))
        yield sched, procs, store
    finally:
        stop_processes(list(procs.values()))
        sched.stop()
        store.stop()
