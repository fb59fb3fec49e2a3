"""The first-build notice on its own (a real thread printing dots into a real stream): the line
names the log, dots come while the build runs, the outcome is printed and logged."""
from __future__ import annotations

import io
import time

import pytest

from epdserve.ops.build_progress import BuildProgress


def test_progress_line_dots_and_outcome(tmp_path):
    out = io.StringIO()
    with BuildProgress(tmp_path / "build.log", out, dot_every_s=0.05):
        time.sleep(0.3)  # the build
    text = out.getvalue()
    assert text.startswith(f"building native operators (first run only, ~1 min); log at {tmp_path / 'build.log'} ")
    assert text.count(".") >= 3 and text.rstrip().endswith("s") and " done in " in text
    assert (tmp_path / "build.log").read_text().startswith("built in ")


def test_a_failed_build_says_so_and_logs_the_compiler_output(tmp_path):
    out = io.StringIO()
    with pytest.raises(RuntimeError):
        with BuildProgress(tmp_path / "build.log", out, dot_every_s=0.05):
            raise RuntimeError("g++: error: csrc/x.cpp: no such file")
    assert "failed after" in out.getvalue() and "see the log" in out.getvalue()
    assert "g++: error: csrc/x.cpp" in (tmp_path / "build.log").read_text()
