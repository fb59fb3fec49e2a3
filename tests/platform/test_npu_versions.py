"""Driver ↔ CANN ↔ torch_npu (platform/npu_versions.py, issue 37 item 6) against Ascend/pytorch's
COMPATIBILITY.en.md: a build on another CANN line fails with the one-line fix; CANN 8.3.RC1 is
named for its reported TND+paged refusal; a driver below torch_npu's own gates warns. Also what
`epdserve doctor` shows with the fake torch_npu installed."""
from __future__ import annotations

import pytest

from epdserve.platform.npu_versions import check, driver_key, main


def _statuses(findings):
    return [f.status for f in findings]


@pytest.mark.parametrize("torch_npu,cann", [("2.12.0", "9.1.0"), ("2.9.0", "8.5.0"), ("2.9.0.post2", "9.0.0"),
                                            ("2.8.0", "8.3.RC2")])
def test_a_build_on_its_cann_line_passes(torch_npu, cann):
    f = check(torch_npu, cann, "25.5.0")
    assert f[0].status == "ok" and "fail" not in _statuses(f)


def test_a_build_on_another_cann_fails_naming_the_build_for_this_cann():
    (f, *_) = check("2.9.0", "9.1.0", "25.5.0")
    assert f.status == "fail" and "built for CANN 8.5.0, this host has CANN 9.1.0" in f.detail
    assert f.fix == "pip install 'torch-npu==2.9.0.post6' (the build for CANN 9.1.0)"


def test_no_build_of_this_torch_for_this_cann_names_the_cann():
    (f, *_) = check("2.12.0", "8.5.0", "25.5.0")
    assert f.status == "fail" and f.fix == "install CANN 9.1.0, the one torch_npu 2.12.0 is built for"


def test_cann_8_3_rc1_is_named_for_the_reported_refusal():
    f = check("2.8.0", "8.3.RC1", "25.0.rc1")
    assert _statuses(f) == ["ok", "warn", "warn", "ok"] and "#4373" in f[1].detail
    assert "not in epdserve's table" in f[2].detail  # no release-note table for 8.3: said, not checked


@pytest.mark.parametrize("cann,driver,status", [
    ("9.1.0", "25.0.0", "fail"),      # CANN 9.1.0 release notes: 9.1.X "N" on HDK 25.0.X
    ("9.1.0", "25.2.0", "ok"),
    ("9.0.0", "25.0.rc1", "ok"),      # 9.0.X "Y" on 25.0.X
    ("8.5.0", "25.5.1", "ok"),        # CANN 8.5.0 mapping: 25.5.X 25.3.X 25.2.X 25.0.X
    ("8.5.0", "24.1.0", "fail"),
    ("9.1.0", "26.2.0", "warn"),      # newer than the newest line the table lists (26.1.0)
])
def test_the_driver_is_checked_against_the_cann_release_notes_table(cann, driver, status):
    from epdserve.platform.npu_versions import _driver_against_cann

    (f,) = _driver_against_cann(driver, cann)
    assert f.status == status, f
    if status == "fail":
        assert f.fix.startswith("upgrade the Ascend HDK driver and firmware to")


def test_a_driver_older_than_the_atlas_800i_a2_supports_fails_for_any_cann():
    f = check("2.8.0", "8.3.RC2", "23.0.6")
    fails = [x for x in f if x.status == "fail"]
    assert len(fails) == 1 and "24.1.RC1" in fails[0].detail


def test_the_command_line_fails_on_a_driver_too_old_for_the_cann(capsys):
    assert main(["--torch-npu", "2.12.0", "--cann", "9.1.0", "--driver", "25.0.0"]) == 1
    assert "fail: driver 25.0.0 is older than CANN 9.1.0 runs on" in capsys.readouterr().out


def test_old_drivers_warn_with_torch_npus_own_thresholds():
    assert driver_key("25.0.rc1") < driver_key("25.0.0") < driver_key("25.5.0") < driver_key("26.0.rc1")
    f = check("2.12.0", "9.1.0", "25.3.rc1")
    assert f[-1].status == "warn" and "aclrtPointerGetAttributes" in f[-1].detail
    f = check("2.8.0", "8.3.RC2", "24.1.rc2")
    assert f[-1].status == "warn" and "25.0.RC1" in f[-1].fix


def test_the_command_line_exits_1_on_a_failure(capsys):
    assert main(["--torch-npu", "2.9.0", "--cann", "9.1.0", "--driver", "25.5.0"]) == 1
    assert "fail: torch_npu 2.9.0 is built for CANN 8.5.0" in capsys.readouterr().out
    assert main(["--torch-npu", "2.12.0", "--cann", "9.1.0", "--driver", "25.5.0"]) == 0


def test_doctor_shows_the_rows_with_the_fake_torch_npu(monkeypatch):
    import importlib.metadata

    from epdserve.checks import doctor as doctor_checks
    from tests.fakes.torch_npu_fake import FakeTorchNpu

    FakeTorchNpu(line="2.9.0", cann="9.1.0", driver="25.5.0").install(monkeypatch)
    real = importlib.metadata.version
    monkeypatch.setattr(importlib.metadata, "version", lambda d: "2.9.0" if d == "torch_npu" else real(d))
    rows = {c.name: c for c in doctor_checks.run_checks(device="cpu")}
    assert rows["NPU versions"].status.value == "fail" and "2.9.0.post6" in rows["NPU versions"].fix
    assert "training products" in rows["NPU core limits"].detail
