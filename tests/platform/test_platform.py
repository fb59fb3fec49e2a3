"""Platform registry: auto-selection, backends, env vars; NPU calls pinned by a contract test.

No NPU exists here, so the NPU tests install tests/fakes/torch_npu_fake.py (a stand-in that
behaves as torch_npu's sources say) and pin the calls epdserve makes: per-thread device and
stream, stream limits (and their failures), the HCCL group, its watchdog setting and real abort.
"""
import datetime
import os
import sys

import pytest
import torch

from epdserve.platform import get_platform
from tests.fakes.torch_npu_fake import FakeTorchNpu


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
    monkeypatch.setenv("TORCH_HCCL_ASYNC_ERROR_HANDLING", "-")  # recorded, so what epdserve sets is undone
    monkeypatch.delenv("TORCH_HCCL_ASYNC_ERROR_HANDLING")
    from epdserve.platform.npu import PLATFORM as npu

    monkeypatch.setattr(npu, "_group_env_set", {}, raising=False)  # what epdserve set for earlier groups
    return FakeTorchNpu().install(monkeypatch)


def test_npu_contract(fake_npu, monkeypatch):
    from epdserve.platform.npu import PLATFORM as npu

    monkeypatch.setattr(npu, "device_limited", True)  # set_device_limit came first (the process's, once)

    assert npu.is_available()
    npu.set_thread_device(0)
    stream = npu.new_stream()
    npu.set_thread_stream(stream)
    assert torch.npu.current_stream() is stream
    assert npu.limit_stream(stream, 8, 16) is True
    assert npu.device_limit() == {"cube_core_num": 20, "vector_core_num": 40}
    # set_stream_limit needs allow_internal_format = False (op-plugin's torch_npu-set_stream_limit.md)
    assert fake_npu.of("set_stream_limit") == [("MainThread", "set_stream_limit", stream.stream_id, 8, 16, False)]
    assert fake_npu.of("set_device") == [("MainThread", "set_device", 0)]


def test_npu_pair_group_turns_the_teardown_watchdog_off(fake_npu):
    from epdserve.platform.npu import PLATFORM as npu

    timeout = datetime.timedelta(seconds=30)
    store = torch.distributed.HashStore()
    pg = npu.make_pair_group(store, 1, 2, timeout, group_name="epdserve-kv/p0-d1")
    assert fake_npu.of("ProcessGroupHCCL") == [("MainThread", "ProcessGroupHCCL", 1, 2, "epdserve-kv/p0-d1", timeout)]
    assert fake_npu.of("_set_sequence_number_for_group") == [("MainThread", "_set_sequence_number_for_group", 1)]
    assert os.environ["TORCH_HCCL_ASYNC_ERROR_HANDLING"] == "0" and pg.error_handling == 0
    npu.interrupt_pair_group(pg, 0)  # the real abort (abort_hccl_comm), not the no-op Backend.abort
    assert [e[1] for e in fake_npu.events if e[1] in ("abort_hccl_comm", "pg.abort")] == ["abort_hccl_comm"]


def test_npu_tensor_parallel_group_keeps_the_teardown_watchdog(fake_npu):
    """A TP group's failed or hung collective must end the process (the instance restarts whole)."""
    from epdserve.platform.npu import PLATFORM as npu

    pg = npu.make_pair_group(torch.distributed.HashStore(), 0, 2, datetime.timedelta(seconds=5), group_name="tp",
                             tensor_parallel=True)
    assert os.environ["TORCH_HCCL_ASYNC_ERROR_HANDLING"] == "1" and pg.error_handling == 1


def test_an_operator_choice_of_teardown_is_kept_and_named(fake_npu, monkeypatch, caplog):
    from epdserve.platform.npu import PLATFORM as npu

    monkeypatch.setenv("TORCH_HCCL_ASYNC_ERROR_HANDLING", "1")
    npu.make_pair_group(torch.distributed.HashStore(), 0, 2, datetime.timedelta(seconds=5), group_name="g")
    assert os.environ["TORCH_HCCL_ASYNC_ERROR_HANDLING"] == "1"
    assert "TORCH_HCCL_ASYNC_ERROR_HANDLING=1 is set" in caplog.text


@pytest.mark.parametrize("how", ["missing_api", "soc_without_it", "not_a_stream"])
def test_npu_stream_limits_never_stop_a_worker(how, monkeypatch, caplog):
    from epdserve.platform.npu import PLATFORM as npu

    fake = FakeTorchNpu(stream_limits=how != "soc_without_it").install(monkeypatch)
    if how == "missing_api":
        monkeypatch.delattr(torch.npu, "set_stream_limit")
    stream = "S" if how == "not_a_stream" else npu.new_stream()
    monkeypatch.setattr(npu, "device_limited", True)  # past the order check: set_device_limit came first
    assert npu.limit_stream(stream, 8, 16) is False
    assert "share cores unrestricted" in caplog.text and not fake.of("set_stream_limit")


def test_interrupt_pair_group_per_backend():
    from epdserve.platform.cuda import PLATFORM as cuda

    calls = []

    class Group:
        def abort(self):
            calls.append("abort")

        def recv(self, tensors, peer, tag):
            calls.append(("recv", peer))
            raise RuntimeError("Application timeout caused pair closure")  # what gloo raises

    cuda.interrupt_pair_group(Group(), 1)  # NCCL: the backend's abort() (HCCL: test_npu_pair_group_...)
    get_platform("cpu").interrupt_pair_group(Group(), 1)  # gloo: abort() would not wake waits
    assert calls == ["abort", ("recv", 1)]


def test_a_tp_instance_s_kv_pairs_get_their_own_watchdog_where_the_backend_reads_it_per_group(monkeypatch):
    """A disaggregated P or D at TP > 1 builds its TP group (TearDown) and then KV pairs (no
    handling) in one process: NCCL reads the variable in each group's constructor, so each gets its
    own; a value the operator set stays."""
    from epdserve.platform.cuda import PLATFORM as cuda

    monkeypatch.setattr(cuda, "_group_env_set", {}, raising=False)
    monkeypatch.setenv("TORCH_NCCL_ASYNC_ERROR_HANDLING", "-")
    monkeypatch.delenv("TORCH_NCCL_ASYNC_ERROR_HANDLING")
    cuda.prepare_pair_groups(tensor_parallel=True)
    assert os.environ["TORCH_NCCL_ASYNC_ERROR_HANDLING"] == "1"
    cuda.prepare_pair_groups()
    assert os.environ["TORCH_NCCL_ASYNC_ERROR_HANDLING"] == "0"
    monkeypatch.setenv("TORCH_NCCL_ASYNC_ERROR_HANDLING", "3")  # the operator's
    cuda.prepare_pair_groups(tensor_parallel=True)
    assert os.environ["TORCH_NCCL_ASYNC_ERROR_HANDLING"] == "3"


def test_on_hccl_the_tp_group_s_teardown_holds_for_the_kv_pairs_and_is_said(fake_npu, monkeypatch, caplog):
    """HCCL reads the variable at the first group only: a TP instance's pairs run under the TP
    group's TearDown (a failed pair restarts the instance, its requests retried), and the log says so."""
    from epdserve.platform.npu import PLATFORM as npu

    npu.make_pair_group(torch.distributed.HashStore(), 0, 2, datetime.timedelta(seconds=5), group_name="tp",
                        tensor_parallel=True)
    npu.make_pair_group(torch.distributed.HashStore(), 0, 2, datetime.timedelta(seconds=5), group_name="epdserve-kv/x")
    assert os.environ["TORCH_HCCL_ASYNC_ERROR_HANDLING"] == "1"
    assert "holds for this process" in caplog.text and "restarts" in caplog.text
