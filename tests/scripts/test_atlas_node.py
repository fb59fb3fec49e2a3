"""scripts/atlas_node.sh on a machine without NPUs: the preflight fails fast with one clear line,
and passes against a fake driver / CANN / npu-smi laid out as on an Atlas server."""

import shutil
import subprocess
from pathlib import Path

import pytest

from tests.scripts.fake_atlas import bare_env, make_fake_atlas

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "atlas_node.sh"


def _run(args, env, timeout=300):  # a hang guard only: a loaded 2-core machine took over 30 s
    return subprocess.run(["bash", str(SCRIPT), *args], env=env, capture_output=True, text=True, timeout=timeout)


@pytest.fixture
def fake_atlas(tmp_path):
    """A fake Ascend install root and a bin/ with npu-smi; returns the env to run the script in."""
    return make_fake_atlas(tmp_path)


def test_preflight_without_npu_smi_fails_fast(tmp_path):
    out = _run(["preflight", "0"], bare_env(tmp_path, "/usr/bin:/bin"))
    assert out.returncode == 1
    assert "npu-smi not found" in out.stderr and "driver" in out.stderr


def test_instances_stop_at_preflight_without_npu_smi(tmp_path):
    env_file = tmp_path / "env"
    env_file.write_text("EPDSERVE_CLUSTER_TOKEN=t\n")
    env_file.chmod(0o600)
    env = dict(bare_env(tmp_path, "/usr/bin:/bin"), MODEL="/m", HEAD_IP="10.0.0.1", MM_STORE="redis://10.0.0.5:6379/0",
               EPDSERVE_ENV_FILE=str(env_file))
    out = _run(["instances", "P", "0"], env)
    assert out.returncode == 1 and "npu-smi not found" in out.stderr


def test_instances_need_the_cluster_redis(tmp_path):
    env = dict(bare_env(tmp_path, "/usr/bin:/bin"), MODEL="/m", HEAD_IP="10.0.0.1")
    out = _run(["instances", "P", "0"], env)
    assert out.returncode != 0 and "MM_STORE" in out.stderr


def test_preflight_passes_on_a_fake_atlas(fake_atlas):
    out = _run(["preflight", "0,1"], dict(fake_atlas, MIN_FREE_HBM_MB="40000"))
    assert out.returncode == 0, out.stderr
    assert "driver 25.0.rc1, CANN 8.2.RC1" in out.stdout
    assert "NPU 1 ok, 49152 MB HBM free" in out.stdout


def test_preflight_reports_short_hbm_and_unknown_npu(fake_atlas):
    out = _run(["preflight", "0"], dict(fake_atlas, MIN_FREE_HBM_MB="60000"))
    assert out.returncode == 1 and "NPU 0 has 49152 MB free HBM, needs 60000 MB" in out.stderr
    out = _run(["preflight", "2"], fake_atlas)
    assert out.returncode == 1 and "NPU 2 not found" in out.stderr


def test_preflight_without_cann_says_so(fake_atlas, tmp_path):
    shutil.rmtree(tmp_path / "Ascend" / "ascend-toolkit")
    out = _run(["preflight", "0"], fake_atlas)
    assert out.returncode == 1 and "CANN not found" in out.stderr


@pytest.mark.parametrize("value", ["0", "-5", "abc", "0.5"])
def test_a_never_timing_out_hccl_exec_timeout_is_refused(tmp_path, value):
    """HCCL_EXEC_TIMEOUT=0 is "never" (torch_npu ProcessGroupHCCL.cpp; strtol reads "abc" / "0.5"
    as 0): a stuck receive's blocks would be held for ever, so the script stops before starting."""
    env = dict(bare_env(tmp_path, "/usr/bin:/bin"), INSECURE="1", NODE_IP="127.0.0.1", NIC="lo", MODEL="/m",
               HCCL_EXEC_TIMEOUT=value)
    out = _run(["head"], env)
    assert out.returncode == 1 and f"HCCL_EXEC_TIMEOUT={value}: HCCL would never time out" in out.stderr


def _with_epdserve(env: dict) -> dict:
    import sys

    root = str(SCRIPT.parents[1])
    return dict(env, PYTHON=sys.executable, PYTHONPATH=root)


def test_preflight_checks_versions_with_the_table(fake_atlas):
    out = _run(["preflight", "0"], dict(_with_epdserve(fake_atlas), MIN_FREE_HBM_MB="40000"))
    assert out.returncode == 0, out.stderr
    assert "preflight: ok: driver 25.0.rc1" in out.stdout  # no torch_npu here: the driver alone is matched
    assert "torch_npu not installed" in out.stderr


def test_preflight_fails_a_torch_npu_built_for_another_cann(fake_atlas, tmp_path):
    """A stand-in torch_npu 2.9.0 (CANN 8.5.0's build) on the fake host's CANN 8.2.RC1."""
    site = tmp_path / "site"
    (site / "torch_npu-2.9.0.dist-info").mkdir(parents=True)
    (site / "torch_npu-2.9.0.dist-info" / "METADATA").write_text("Metadata-Version: 2.1\nName: torch_npu\nVersion: 2.9.0\n")
    env = _with_epdserve(fake_atlas)
    env["PYTHONPATH"] += f":{site}"
    out = _run(["preflight", "0"], dict(env, MIN_FREE_HBM_MB="40000"))
    assert out.returncode == 1
    assert "preflight: fail: torch_npu 2.9.0 is built for CANN 8.5.0, this host has CANN 8.2.RC1 -- fix: install CANN 8.5.0" in out.stderr
