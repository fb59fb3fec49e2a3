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


def _kv(**kw):
    base = dict(degree=1, num_layers=2, num_kv_heads=2, head_dim=8, block_size=16, dtype="float32")
    return common_pb2.KvLayout(**{**base, **kw})


def test_a_p_and_a_d_whose_kv_layouts_cannot_map_are_refused_at_registration():
    reg = InstanceRegistry()
    reg.register(status("d9", "D"))  # no record (an instance from before it): nothing to compare
    s = status("p0", "P")
    s.kv_layout.CopyFrom(_kv())
    reg.register(s)
    ok = status("d0", "D")
    ok.kv_layout.CopyFrom(_kv())
    assert reg.register(ok).kv_layout.dtype == "float32"
    for field, value, why in (("dtype", "bfloat16", "dtype differs (float32 vs bfloat16)"),
                              ("block_size", 128, "block_size differs (16 vs 128)"),
                              ("num_kv_heads", 4, "num_kv_heads differs (2 vs 4)"),
                              ("quantization", "int8", "quantized differently (unquantized vs int8)")):
        bad = status("d1", "ED")
        bad.kv_layout.CopyFrom(_kv(**{field: value}))
        with pytest.raises(RegistryError) as e:
            reg.register(bad)
        assert why in str(e.value) and "d1 cannot pair with p0" in str(e.value)
        assert "P: TP1 (KV heads rank0 0-1 of 2)" in str(e.value) and reg.get("d1") is None
    # the same from the P side: a second P against the registered D
    bad = status("p1", "P+E")
    bad.kv_layout.CopyFrom(_kv(head_dim=16))
    with pytest.raises(RegistryError, match="p1 cannot pair with d0: .* prefill instance p1 .* decode instance d0"):
        reg.register(bad)
    # coupled instances never hop KV: another block size registers, another dtype or quantization does not
    for iid, roles in (("c0", "PD"), ("c1", "EPD")):
        other = status(iid, roles)
        other.kv_layout.CopyFrom(_kv(block_size=128))
        reg.register(other)
        for kw in ({"dtype": "bfloat16"}, {"quantization": "w8a8"}):
            other.kv_layout.CopyFrom(_kv(**kw))
            with pytest.raises(RegistryError, match=f"{iid} runs the model in .* but .* one scheduler serves one model"):
                reg.register(other)
    # so does a P when the D is down
    assert reg.register(s).kv_layout.head_dim == 8  # p0 again: compared with d0, not with its old self
    reg.get("d0").health = DOWN
    assert reg.register(bad).kv_layout.head_dim == 16
    # another degree maps: each D rank gets its own KV heads from the P ranks holding them (transfer/kv/links.py)
    fresh, p4, d2 = InstanceRegistry(), status("p4", "P"), status("d2", "D")
    p4.kv_layout.CopyFrom(_kv(degree=4))
    d2.kv_layout.CopyFrom(_kv(degree=2))
    assert fresh.register(p4).kv_layout.degree == 4 and fresh.register(d2).kv_layout.degree == 2
