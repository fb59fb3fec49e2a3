"""Co-located stages on an NPU, against tests/fakes/torch_npu_fake.py: each stage thread gets its
own stream limited to its share of the cores, and no failure of the core-limit API (older
torch_npu, a CANN without aclrtSetStreamResLimit) stops a stage from starting."""
import threading

import pytest
import torch

from epdserve.instance.stage_stream import open_stage_stream
from epdserve.platform.cpu import CpuPlatform
from epdserve.platform.npu import NpuPlatform
from tests.fakes.torch_npu_fake import FakeTorchNpu


def _open_in_threads(shares: dict[str, float]) -> dict:
    npu, out = NpuPlatform(), {}
    npu.set_thread_device(0)
    total = npu.device_limit() if hasattr(torch.npu, "get_device_limit") else {"cube_core_num": 20, "vector_core_num": 40}
    npu.limit_device(0, total["cube_core_num"], total["vector_core_num"])  # set_device_limit first (its doc)

    def stage(name, share):
        npu.set_thread_device(0)
        out[name] = open_stage_stream(npu, share, name)

    threads = [threading.Thread(target=stage, args=item, name=item[0]) for item in shares.items()]
    for t in threads:
        t.start()
    for t in threads:
        t.join(10)
    return out


def test_co_located_stages_get_their_own_limited_streams(monkeypatch):
    fake = FakeTorchNpu(cores=(20, 40)).install(monkeypatch)
    streams = _open_in_threads({"E-worker": 0.3, "P-worker": 0.7})
    assert streams["E-worker"] is not streams["P-worker"]
    limits = {e[0]: e[2:] for e in fake.of("set_stream_limit")}
    assert limits == {"E-worker": (streams["E-worker"].stream_id, 6, 12, False),
                      "P-worker": (streams["P-worker"].stream_id, 14, 28, False)}


@pytest.mark.parametrize("how", ["soc_without_it", "old_torch_npu"])
def test_a_stage_starts_when_core_limits_fail(how, monkeypatch, caplog):
    fake = FakeTorchNpu(stream_limits=how != "soc_without_it").install(monkeypatch)
    if how == "old_torch_npu":
        monkeypatch.delattr(torch.npu, "get_device_limit")
    streams = _open_in_threads({"E-worker": 0.5, "D-worker": 0.5})
    assert all(s is not None and s.limits is None for s in streams.values())
    assert "unrestricted" in caplog.text and not fake.of("set_stream_limit")


def test_yield_gives_unlimited_streams_of_their_own_without_priorities(monkeypatch):
    """NPU streams have no priority (torch_npu: pool streams at ACL priority 0, Stream.priority
    raises): the priority asked for is not passed on, and each stage still gets its own stream."""
    fake = FakeTorchNpu().install(monkeypatch)
    npu = NpuPlatform()
    npu.set_thread_device(0)
    e = open_stage_stream(npu, None, "E-worker", priority=0)
    d = open_stage_stream(npu, None, "D-worker", priority=-1)
    assert e != d and e.limits is d.limits is None
    with pytest.raises(RuntimeError, match="get_priority"):
        e.priority
    assert not fake.of("set_stream_limit")


def test_no_streams_on_cpu():
    assert open_stage_stream(CpuPlatform(), 0.5, "E-worker") is None


def test_a_stream_limit_before_the_device_limit_is_refused(monkeypatch, caplog):
    """op-plugin torch_npu-set_stream_limit.md (7.2.0, 7.3.0, 26.0.0): "must be called after
    torch.npu.set_device_limit"; without it the stream stays unrestricted, said once."""
    fake = FakeTorchNpu().install(monkeypatch)
    npu = NpuPlatform()
    npu.set_thread_device(0)
    assert open_stage_stream(npu, 0.5, "E-worker").limits is None
    assert "set_stream_limit before set_device_limit" in caplog.text and not fake.of("set_stream_limit")
