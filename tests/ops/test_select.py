"""Choosing the paged operators: EPDSERVE_OPS (the engine's `ops` setting when not given), the fallback when the native build fails (said
once), and CI=true refusing that fallback. The failing build is real: a subprocess whose PATH
has no ninja and whose build cache is empty."""
import os
import subprocess
import sys

import pytest

from epdserve.engine.config import EngineConfig
from epdserve.ops.select import NativeOpsUnavailable, paged_ops
from epdserve.platform import get_platform
from epdserve.platform.cuda import CudaPlatform

PROBE = """
import logging, sys
logging.basicConfig(level=logging.WARNING)
from epdserve.engine.config import EngineConfig
from epdserve.ops.select import paged_ops
from epdserve.platform import get_platform
try:
    choice = EngineConfig(model="unused").ops  # $EPDSERVE_OPS, as an engine reads it
    print("ops:", paged_ops(get_platform("cpu"), choice).name, paged_ops(get_platform("cpu"), choice).name)
except Exception as e:
    print("raised:", type(e).__name__, e)
"""


def _probe(tmp_path, **env):
    base = {k: v for k, v in os.environ.items() if k not in ("CI", "EPDSERVE_OPS")}
    base.update(PATH=str(tmp_path), EPDSERVE_OPS_CACHE=str(tmp_path / "cache"), **env)  # no ninja, no compiler
    r = subprocess.run([sys.executable, "-c", PROBE], env=base, capture_output=True, text=True, timeout=120)
    return r.stdout, r.stderr


def test_explicit_choice(monkeypatch):
    cpu = get_platform("cpu")
    assert paged_ops(cpu, "portable").name == "portable"
    assert paged_ops(cpu, "native").name == "native"
    monkeypatch.setenv("EPDSERVE_OPS", "portable")  # the engine's `ops` setting, when not given
    assert EngineConfig(model="unused").ops == "portable" and EngineConfig(model="unused", ops="native").ops == "native"
    assert paged_ops(cpu, EngineConfig(model="unused").ops).name == "portable"
    monkeypatch.setenv("EPDSERVE_OPS", " Native ")
    assert EngineConfig(model="unused").ops == "native"
    monkeypatch.setenv("EPDSERVE_OPS", "fast")
    with pytest.raises(ValueError, match="EPDSERVE_OPS must be one of native, portable"):
        EngineConfig(model="unused")
    with pytest.raises(ValueError, match="native, portable"):
        paged_ops(cpu, "fast")


def test_failed_build_falls_back_once_with_the_reason(tmp_path):
    out, err = _probe(tmp_path)
    assert "ops: portable portable" in out
    assert err.count("native paged operators unavailable (") == 1  # once, with the build's error in brackets
    assert "using the portable torch ones" in err


def test_failed_build_fails_under_ci_and_when_asked_for(tmp_path):
    out, _ = _probe(tmp_path, CI="true")
    assert "raised: NativeOpsUnavailable" in out
    out, _ = _probe(tmp_path, EPDSERVE_OPS="native")
    assert "raised: NativeOpsUnavailable" in out


def test_no_native_kernels_for_cuda_tensors():
    with pytest.raises(NativeOpsUnavailable, match="CPU kernels only"):
        paged_ops(CudaPlatform(), "native")  # the selection only reads its name: no GPU needed


def test_native_on_npu_is_an_error_not_a_silent_switch(monkeypatch):
    class Npu:  # the selection only reads the platform's name: no torch_npu needed
        name = "npu"

    monkeypatch.setenv("EPDSERVE_OPS", "native")
    with pytest.raises(NativeOpsUnavailable, match="EPDSERVE_OPS=native: no native paged operators for npu"):
        paged_ops(Npu(), EngineConfig(model="unused").ops)
    assert paged_ops(Npu(), "portable").name == "portable"
