"""Instance registry: roster, namespace guard and health hysteresis (unit level, plus the prober
against real gRPC health servers on loopback)."""
import asyncio
from concurrent import futures

import grpc
import pytest

from epdserve.rpc import INSTANCE_SERVICE, common_pb2
from epdserve.rpc.servers import add_health_and_reflection, free_port, set_serving
from epdserve.scheduler.channels import ChannelPool
from epdserve.scheduler.config import SchedulerConfig
from epdserve.scheduler.health import HealthProber
from epdserve.scheduler.registry import DOWN, HEALTHY, SUSPECT, InstanceRegistry, RegistryError


def status(iid, roles="EPD", ns="m@1", address=None):
    return common_pb2.InstanceStatus(instance_id=iid, roles=roles, address=address or f"127.0.0.1:{1000 + len(iid)}",
                                     media_namespace=ns)


class Clock:
    def __init__(self):
        self.t = 1000.0

    def __call__(self):
        return self.t


def test_roles_are_normalized_and_validated():
    reg = InstanceRegistry()
    assert reg.register(status("a", "pe")).roles == "EP"
    assert reg.register(status("b", "DPE")).roles == "EPD"
    for bad in ("", "X", "EPX", "EX", "EE"):
        with pytest.raises(RegistryError, match="roles must be one of"):
            reg.register(status("c", bad))
    assert reg.get("c") is None


def test_register_candidates_and_namespace_guard():
    reg = InstanceRegistry()
    reg.register(status("e0", "E"))
    reg.register(status("p0", "EP"))
    reg.register(status("d0", "D", ns=""))
    reg.register(status("c0", "PD"))
    assert [r.instance_id for r in reg.candidates("E")] == ["e0", "p0"]
    assert [r.instance_id for r in reg.candidates("P")] == ["c0", "p0"]
    assert [r.instance_id for r in reg.candidates("PD")] == ["c0"]
    assert reg.namespace == "m@1"
    with pytest.raises(RegistryError, match="namespace"):
        reg.register(status("x0", "E", ns="other@2"))
    with pytest.raises(RegistryError):
        reg.register(status("", "E"))
    assert reg.deregister("e0") and not reg.deregister("e0")
    assert reg.heartbeat("p0") and not reg.heartbeat("nobody")


def test_hysteresis_drop_after_n_rejoin_after_m():
    downs = []
    reg = InstanceRegistry(unhealthy_after=3, healthy_after=2)
    reg.on_down(lambda rec: downs.append(rec.instance_id))
    reg.register(status("a"))
    reg.record_failure("a")
    assert reg.get("a").health == SUSPECT and reg.candidates("P")  # suspect is still routed to
    reg.record_success("a")
    assert reg.get("a").health == HEALTHY
    for _ in range(3):
        reg.record_failure("a")
    assert reg.get("a").health == DOWN and reg.candidates("P") == [] and downs == ["a"]
    reg.record_failure("a")
    assert downs == ["a"]  # told once
    reg.record_success("a")
    assert reg.get("a").health == DOWN  # one good probe is not enough
    reg.record_failure("a")
    reg.record_success("a")
    assert reg.get("a").health == DOWN  # the streak restarted
    reg.record_success("a")
    assert reg.get("a").health == HEALTHY and reg.candidates("P")


def test_register_makes_a_down_instance_healthy_and_stale_ones_are_forgotten():
    clock = Clock()
    reg = InstanceRegistry(unhealthy_after=1, forget_after_s=60, clock=clock)
    reg.register(status("a"))
    reg.register(status("b"))
    reg.record_failure("a")
    reg.record_failure("b")
    assert reg.get("a").health == DOWN
    reg.register(status("a"))  # the process restarted
    assert reg.get("a").health == HEALTHY
    clock.t += 61
    assert reg.forget_stale() == ["b"]
    assert [r.instance_id for r in reg.records()] == ["a"]


class HealthServer:
    """A real gRPC server that only answers grpc.health.v1 (status settable)."""

    def __init__(self):
        self.port = free_port()
        self.server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
        self.health = add_health_and_reflection(self.server, [INSTANCE_SERVICE])
        set_serving(self.health, [INSTANCE_SERVICE])
        self.server.add_insecure_port(f"127.0.0.1:{self.port}")
        self.server.start()

    def set(self, serving: bool):
        set_serving(self.health, [INSTANCE_SERVICE], serving)


def test_prober_hysteresis_against_real_health_servers():
    a, b = HealthServer(), HealthServer()
    dead_port = free_port()  # nothing listens here
    cfg = SchedulerConfig(model="unused", unhealthy_after=2, healthy_after=2, probe_timeout_s=2.0)

    async def scenario():
        reg = InstanceRegistry(cfg.unhealthy_after, cfg.healthy_after)
        channels = ChannelPool()
        prober = HealthProber(cfg, reg, channels)
        reg.register(status("a", address=f"127.0.0.1:{a.port}"))
        reg.register(status("b", address=f"127.0.0.1:{b.port}"))
        reg.register(status("dead", address=f"127.0.0.1:{dead_port}"))
        await prober.probe_round()
        seen = [(reg.get("a").health, reg.get("b").health, reg.get("dead").health)]
        b.set(False)
        await prober.probe_round()
        await prober.probe_round()
        seen.append((reg.get("a").health, reg.get("b").health, reg.get("dead").health))
        b.set(True)
        await prober.probe_round()
        seen.append(reg.get("b").health)
        await prober.probe_round()
        seen.append(reg.get("b").health)
        await channels.close()
        return seen

    try:
        seen = asyncio.run(scenario())
    finally:
        a.server.stop(0)
        b.server.stop(0)
    assert seen[0] == (HEALTHY, HEALTHY, SUSPECT)
    assert seen[1] == (HEALTHY, DOWN, DOWN)
    assert seen[2:] == [DOWN, HEALTHY]
