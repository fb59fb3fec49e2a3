"""Platform registry: auto-selection, backends, env vars; NPU calls pinned by a contract test.

No NPU exists here, so the NPU test injects a recording stand-in for torch_npu / torch.npu and
pins the exact calls epdserve makes (names, arguments, order) — the contract with torch_npu.
"""
import datetime
import sys
import types

import pytest
import torch

from epdserve.platform import get_platform


def test_auto_picks_cpu_here():
    plat = get_platform("auto")
    assert plat.name == "cpu" and plat.dist_backend == "gloo"
    assert plat.device() == torch.device("cpu")


def test_backends_and_env_vars():
    assert get_platform("cpu").visible_devices_env is None
    from epdserve.platform.cuda import PLATFORM as cuda
    from epdserve.platform.npu import PLATFORM as npu

    assert (cuda.dist_backend, cuda.visible_devices_env) == ("nccl", "CUDA_VISIBLE_DEVICES")
    assert (npu.dist_backend, npu.visible_devices_env) == ("hccl", "ASCEND_RT_VISIBLE_DEVICES")


def test_unknown_or_missing_device_is_a_clear_error():
    with pytest.raises(ValueError, match="unknown device"):
        get_platform("tpu")
    with pytest.raises(RuntimeError, match="not available"):
        get_platform("npu")  # torch_npu is not installed here


def test_npu_is_not_imported_by_cpu_code():
    get_platform("auto")
    assert "torch_npu" not in sys.modules


@pytest.fixture
def fake_npu(monkeypatch):
    calls = []

    class Options:
        def __init__(self):
            self._timeout = None

    class ProcessGroupHCCL:
        def __init__(self, store, rank, size, opts):
            calls.append(("ProcessGroupHCCL", store, rank, size, opts._timeout, opts.group_id,
                          opts.is_high_priority_stream, opts.global_ranks_in_group))

        def _set_sequence_number_for_group(self):
            calls.append(("_set_sequence_number_for_group",))

    ProcessGroupHCCL.Options = Options
    c10d = types.SimpleNamespace(ProcessGroupHCCL=ProcessGroupHCCL)
    torch_npu = types.ModuleType("torch_npu")
    torch_npu._C = types.SimpleNamespace(_distributed_c10d=c10d)
    npu_ns = types.SimpleNamespace(
        is_available=lambda: True,
        set_stream_limit=lambda stream, cube, vector: calls.append(("set_stream_limit", stream, cube, vector)),
        current_device=lambda: 0,
        set_device=lambda dev: calls.append(("set_device", dev)),  # torch_npu/npu/utils.py set_device(device)
        get_device_limit=lambda dev: calls.append(("get_device_limit", dev)) or {"cube_core_num": 24, "vector_core_num": 48},
    )
    torch_npu.npu = npu_ns  # torch_npu patches torch.npu with this same module
    monkeypatch.setitem(sys.modules, "torch_npu", torch_npu)
    monkeypatch.setattr(torch, "npu", npu_ns, raising=False)
    return calls


def test_npu_contract(fake_npu):
    from epdserve.platform.npu import PLATFORM as npu

    assert npu.is_available()
    timeout = datetime.timedelta(seconds=30)
    npu.set_thread_device(0)
    npu.make_pair_group("STORE", 1, 2, timeout, group_name="epdserve-kv/p0-d1")
    assert npu.limit_stream("S", 8, 16) is True
    assert npu.device_limit() == {"cube_core_num": 24, "vector_core_num": 48}
    assert fake_npu == [
        ("set_device", 0),
        ("ProcessGroupHCCL", "STORE", 1, 2, timeout, "epdserve-kv/p0-d1", False, []),
        ("_set_sequence_number_for_group",),
        ("set_stream_limit", "S", 8, 16),
        ("get_device_limit", 0),
    ]


def test_npu_without_stream_limits_degrades(fake_npu, monkeypatch, caplog):
    from epdserve.platform.npu import PLATFORM as npu

    monkeypatch.delattr(torch.npu, "set_stream_limit")
    assert npu.limit_stream("S", 8, 16) is False
    assert "set_stream_limit" in caplog.text


def test_interrupt_pair_group_per_backend():
    from epdserve.platform.cuda import PLATFORM as cuda

    calls = []

    class Group:
        def abort(self):
            calls.append("abort")

        def recv(self, tensors, peer, tag):
            calls.append(("recv", peer))
            raise RuntimeError("Application timeout caused pair closure")  # what gloo raises

    cuda.interrupt_pair_group(Group(), 1)  # NCCL (and HCCL): the backend's abort()
    get_platform("cpu").interrupt_pair_group(Group(), 1)  # gloo: abort() would not wake waits
    assert calls == ["abort", ("recv", 1)]
