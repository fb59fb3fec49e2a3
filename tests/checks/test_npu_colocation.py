"""`epdserve bench colocation --device npu` (checks/npu/colocation.py): without an NPU it stops at
once with the reason — a SystemExit carrying a message, no traceback, no model built — and its
table names every kernel over its stage's limit. The profiler run itself needs a real NPU."""
import pathlib
import subprocess
import sys

import pytest

from epdserve.checks.npu import colocation as colocation_npu


def test_without_an_npu_the_check_stops_with_the_reason(monkeypatch):
    monkeypatch.setattr("epdserve.platform.npu.NpuPlatform.unavailable_reason", lambda self: "no NPU here")
    with pytest.raises(SystemExit) as stop:
        colocation_npu.require_npu()
    assert str(stop.value) == "bench colocation --device npu needs an Ascend NPU with torch_npu: no NPU here"


def test_the_command_line_fails_clearly_on_this_machine(tmp_path):
    out = subprocess.run([str(pathlib.Path(sys.executable).with_name("epdserve")), "bench", "colocation", "--device", "npu",
                          "--out", str(tmp_path / "r.json")], capture_output=True, text=True, timeout=120)
    assert out.returncode != 0 and "Traceback" not in out.stderr
    assert "bench colocation --device npu needs an Ascend NPU with torch_npu:" in out.stderr
    assert not (tmp_path / "r.json").exists()


def test_the_table_names_kernels_over_their_limit():
    rows = [{"stage": "E", "stream_limited": True, "cube_limit": 12, "vector_limit": 24, "kernels": 40,
             "checked": 38, "max_block_dim": 24, "over_limit": [], "passed": True},
            {"stage": "D", "stream_limited": True, "cube_limit": 12, "vector_limit": 24, "kernels": 30,
             "checked": 30, "max_block_dim": 40, "over_limit": ["aclnnSilu_SiluAiCore_Swish"], "passed": False}]
    text = colocation_npu.table(rows)
    assert "| pass" in text and "FAIL over limit: aclnnSilu_SiluAiCore_Swish" in text
