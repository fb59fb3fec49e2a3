"""When a role switch is overlapped (`--switch-overlap`, InstanceHost.overlaps_switches): always on
CPU under auto, and on an NPU (tests/fakes/torch_npu_fake.py, which answers torch.npu.mem_get_info /
memory_reserved / memory_allocated as torch_npu does) only when the device's spare memory holds
OVERLAP_HEADROOM times the new workers' KV caches."""
from types import SimpleNamespace

import pytest

from epdserve.instance.config import InstanceConfig
from epdserve.instance.host import _E_KV_BYTES, OVERLAP_HEADROOM, InstanceHost
from epdserve.platform.cpu import CpuPlatform
from epdserve.platform.npu import NpuPlatform
from tests.fakes.torch_npu_fake import FakeTorchNpu

GIB = 1 << 30


def _host(device: str, platform, **cfg) -> InstanceHost:
    host = InstanceHost(InstanceConfig(roles="EPD", model="/unused", device=device, **cfg))
    host.model = SimpleNamespace(platform=platform, device=SimpleNamespace(index=1 if ":1" in device else 0))
    return host


def test_npu_spare_memory_is_runtime_free_plus_the_allocators_unused_cache(monkeypatch):
    fake = FakeTorchNpu(devices=2).install(monkeypatch)
    fake.memory[1] = (10 * GIB, 3 * GIB, 1 * GIB, 64 * GIB)  # free, reserved, allocated, total
    assert NpuPlatform().spare_memory_bytes(1) == 12 * GIB
    with pytest.raises(AssertionError, match="Invalid device id"):
        NpuPlatform().spare_memory_bytes(2)
    assert CpuPlatform().spare_memory_bytes() is None


@pytest.mark.parametrize("spare_gib, roles, expect", [
    (12, "P+E", True),    # one new worker, an 8 GiB KV cache: 1.25 x 8 = 10 GiB needed
    (9, "P+E", False),
    (12, "ED", True),     # E's small cache (8 MiB) + D's 8 GiB
    (10, "EP", False),    # the same two caches: 1.25 x (8 GiB + 8 MiB) = 10.01 GiB
    (11, "EP", True),
    (10, "PD", True),     # one coupled engine's cache: exactly 10 GiB
])
def test_auto_on_an_npu_overlaps_when_the_new_caches_fit(monkeypatch, spare_gib, roles, expect):
    fake = FakeTorchNpu(devices=2).install(monkeypatch)
    fake.memory[1] = (spare_gib * GIB, 0, 0, 64 * GIB)
    assert OVERLAP_HEADROOM == 1.25 and _E_KV_BYTES == 8 << 20
    host = _host("npu:1", NpuPlatform(), kv_cache_bytes=8 * GIB)
    assert host.overlaps_switches(roles) is expect


def test_the_flag_decides_before_memory(monkeypatch):
    fake = FakeTorchNpu().install(monkeypatch)
    fake.memory[0] = (0, 0, 0, 64 * GIB)  # no room at all
    assert _host("npu", NpuPlatform(), switch_overlap="on").overlaps_switches("PD")
    assert not _host("npu", NpuPlatform()).overlaps_switches("PD")
    assert _host("cpu", CpuPlatform()).overlaps_switches("PD")  # auto on CPU
    assert not _host("cpu", CpuPlatform(), switch_overlap="off").overlaps_switches("PD")
    with pytest.raises(ValueError, match="switch_overlap"):
        InstanceConfig(roles="PD", model="/unused", switch_overlap="sometimes")
