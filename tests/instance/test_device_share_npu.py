"""--device-core-share: an E process beside a P process on one NPU, each limited once per process
with `torch.npu.set_device_limit` (the fake models torch_npu/npu/npu_config.py `set_device_limit`
per line: `_call_once_class`, an int device on 2.12.0), and not where one of the process's
operators ignores core limits (the ATB KV write of 2.8.0 / 2.9.0)."""
import logging

import pytest

from epdserve.instance.config import InstanceConfig
from epdserve.instance.device_share import apply_device_share
from epdserve.ops.npu_schema import installed_kv_write
from epdserve.platform.cpu import CpuPlatform
from epdserve.platform.npu import NpuPlatform
from tests.fakes.torch_npu_fake import FakeTorchNpu


@pytest.mark.parametrize("line", ["2.8.0", "2.12.0"])
def test_an_e_process_takes_its_share_once(line, monkeypatch, caplog):
    fake = FakeTorchNpu(line=line, cores=(24, 48)).install(monkeypatch)
    npu = NpuPlatform()
    npu.set_thread_device(0)
    assert apply_device_share(npu, 0, 0.25, ["E"], installed_kv_write(), opted_in=True)
    assert npu.device_limit() == {"cube_core_num": 6, "vector_core_num": 12}
    with caplog.at_level(logging.WARNING):  # a second call in the process: torch_npu refuses it
        assert not apply_device_share(npu, 0, 0.5, ["E"], installed_kv_write(), opted_in=True)
    assert "already been called" in caplog.text and npu.device_limit()["cube_core_num"] == 6
    assert fake.line == line


def test_a_p_process_on_2_12_takes_its_share(monkeypatch):
    FakeTorchNpu(line="2.12.0", cores=(24, 48)).install(monkeypatch)
    npu = NpuPlatform()
    npu.set_thread_device(0)
    assert apply_device_share(npu, 0, 0.75, ["P"], installed_kv_write(), opted_in=True)
    assert npu.device_limit() == {"cube_core_num": 18, "vector_core_num": 36}


@pytest.mark.parametrize("line", ["2.8.0", "2.9.0"])
def test_a_process_with_the_atb_kv_write_is_not_limited_and_the_warning_names_it(line, monkeypatch, caplog):
    FakeTorchNpu(line=line, cores=(24, 48)).install(monkeypatch)
    npu = NpuPlatform()
    npu.set_thread_device(0)
    with caplog.at_level(logging.WARNING):
        assert not apply_device_share(npu, 0, 0.75, ["E", "P"], installed_kv_write(), opted_in=True)
    assert "instance (E+P): no device core limit: _npu_reshape_and_cache ignore(s) core limits" in caplog.text
    assert npu.device_limit() == {"cube_core_num": 24, "vector_core_num": 48}


def test_off_by_default_where_operators_are_unverified(monkeypatch, caplog):
    FakeTorchNpu(line="2.12.0", cores=(24, 48)).install(monkeypatch)
    npu = NpuPlatform()
    npu.set_thread_device(0)
    with caplog.at_level(logging.WARNING):
        assert not apply_device_share(npu, 0, 0.25, ["E"], installed_kv_write())
    assert "no device core limit (off by default on NPU)" in caplog.text and not npu.device_limited
    assert npu.device_limit() == {"cube_core_num": 24, "vector_core_num": 48}


def test_no_share_no_call_and_cpu_ignores_it(monkeypatch, caplog):
    FakeTorchNpu(line="2.12.0").install(monkeypatch)
    assert not apply_device_share(NpuPlatform(), 0, None, ["E"], None)
    with caplog.at_level(logging.WARNING):
        assert not apply_device_share(CpuPlatform(), 0, 0.5, ["E"], None)
    assert "NPUs only" in caplog.text


def test_the_setting_is_a_flag_and_checked():
    assert InstanceConfig(roles="E", model="m", device_core_share=0.3).device_core_share == 0.3
    assert InstanceConfig(roles="E", model="m").npu_core_limits is False  # issue 37 item 5: off by default
    with pytest.raises(ValueError, match="device_core_share"):
        InstanceConfig(roles="E", model="m", device_core_share=1.5)
    import argparse

    from epdserve.instance.config import add_instance_args, from_args
    p = argparse.ArgumentParser()
    add_instance_args(p)
    assert from_args(p.parse_args(["--roles", "E", "--model", "m", "--device-core-share", "0.4"])).device_core_share == 0.4
