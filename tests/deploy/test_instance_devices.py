"""Which accelerator each launched instance sees: its own by default (round-robin over the visible
devices), the named ones with --devices, nothing to set on CPU. No accelerator exists here, so
the accelerator platforms report a device count of 4 (the only thing the assignment reads)."""
from epdserve.deploy.local.deployment import instance_device_env
from epdserve.platform.cpu import CpuPlatform
from epdserve.platform.cuda import CudaPlatform
from epdserve.platform.npu import NpuPlatform


class _FourNpus(NpuPlatform):
    def device_count(self) -> int:
        return 4


class _FourGpus(CudaPlatform):
    def device_count(self) -> int:
        return 4


def test_each_instance_gets_its_own_device_by_default():
    got = [instance_device_env(_FourNpus(), [], k) for k in range(6)]
    assert got == [{"ASCEND_RT_VISIBLE_DEVICES": d} for d in "012301"]
    assert instance_device_env(_FourGpus(), [], 2) == {"CUDA_VISIBLE_DEVICES": "2"}


def test_named_devices_round_robin():
    got = [instance_device_env(_FourNpus(), ["4", "6"], k)["ASCEND_RT_VISIBLE_DEVICES"] for k in range(3)]
    assert got == ["4", "6", "4"]


def test_cpu_sets_nothing():
    assert instance_device_env(CpuPlatform(), [], 0) == {}
    assert CpuPlatform().device_count() == 1
