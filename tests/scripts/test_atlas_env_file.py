"""scripts/atlas_node.sh keeps secrets off command lines: it starts nothing without its env file
(0600, a regular file of this user's, with the cluster token, and the API key on the head), and
refuses a password inside MM_STORE, each time with one line saying how to fix it. Nothing here
needs an NPU or starts epdserve: every case stops before the first process."""

import os
import stat
import subprocess
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "atlas_node.sh"


def _run(args, env):
    return subprocess.run(["bash", str(SCRIPT), *args], env=env, capture_output=True, text=True, timeout=30)


def _one_line(out) -> str:
    assert out.returncode == 1, (out.stdout, out.stderr)
    lines = out.stderr.strip().splitlines()
    assert len(lines) == 1, out.stderr
    return lines[0]


@pytest.fixture
def env(tmp_path):
    """No env file yet; DEVICE=cpu, so `instances` has no preflight to stop at first."""
    return {"PATH": "/usr/bin:/bin", "HOME": str(tmp_path), "DEVICE": "cpu", "MODEL": "/m", "HEAD_IP": "127.0.0.1",
            "NODE_IP": "127.0.0.1", "NIC": "lo", "MM_STORE": "redis://127.0.0.1:6379/0",
            "EPDSERVE_ENV_FILE": str(tmp_path / "secrets" / "env")}


def _write(path: Path, text: str, mode: int = 0o600) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    path.chmod(mode)
    return path


def test_missing_env_file_is_refused(env):
    for args in (["head"], ["instances", "EPD", "0"]):
        line = _one_line(_run(args, env))
        assert f"no env file {env['EPDSERVE_ENV_FILE']}" in line and "atlas_node.sh new-env" in line


def test_env_file_readable_by_others_is_refused(env):
    f = _write(Path(env["EPDSERVE_ENV_FILE"]), "EPDSERVE_CLUSTER_TOKEN=t\nEPDSERVE_API_KEY=k\n", 0o644)
    line = _one_line(_run(["head"], env))
    assert "mode 644" in line and f"chmod 600 {f}" in line
    f.chmod(0o620)  # group-writable: refused too (as ssh refuses such a key)
    assert "chmod 600" in _one_line(_run(["check-env", "head"], env))


def test_env_file_must_be_a_regular_file(env, tmp_path):
    Path(env["EPDSERVE_ENV_FILE"]).mkdir(parents=True)
    assert "is not a regular file" in _one_line(_run(["head"], env))


@pytest.mark.skipif(os.geteuid() != 0, reason="giving a file to another user needs root")
def test_env_file_of_another_user_is_refused(env):
    f = _write(Path(env["EPDSERVE_ENV_FILE"]), "EPDSERVE_CLUSTER_TOKEN=t\nEPDSERVE_API_KEY=k\n")
    os.chown(f, 65534, -1)
    assert "is not owned by" in _one_line(_run(["head"], env))


def test_env_file_needs_the_token_and_on_the_head_the_key(env):
    f = _write(Path(env["EPDSERVE_ENV_FILE"]), "EPDSERVE_API_KEY=k\n")
    assert "sets no EPDSERVE_CLUSTER_TOKEN" in _one_line(_run(["instances", "EPD", "0"], env))
    _write(f, "EPDSERVE_CLUSTER_TOKEN=t\n")
    assert "sets no EPDSERVE_API_KEY" in _one_line(_run(["head"], env))
    assert _run(["check-env"], env).returncode == 0  # instances need no API key


@pytest.mark.parametrize("url", ["redis://:s3cr3t-pw@10.0.0.5:6379/0", "rediss://alice:s3cr3t-pw@redis.example:6380/0",
                                 "redis://10.0.0.5:6379/0?password=s3cr3t-pw"])
def test_password_in_mm_store_is_refused_without_echoing_it(env, url):
    _write(Path(env["EPDSERVE_ENV_FILE"]), "EPDSERVE_CLUSTER_TOKEN=t\n")
    line = _one_line(_run(["instances", "EPD", "0"], dict(env, MM_STORE=url)))
    assert "MM_STORE carries a password" in line and "EPDSERVE_MM_STORE_PASSWORD" in line
    assert env["EPDSERVE_ENV_FILE"] in line and "s3cr3t-pw" not in line


def test_new_env_writes_a_private_file_it_then_accepts(env):
    out = _run(["new-env"], env)
    assert out.returncode == 0, out.stderr
    f = Path(env["EPDSERVE_ENV_FILE"])
    assert stat.S_IMODE(f.stat().st_mode) == 0o600 and stat.S_IMODE(f.parent.stat().st_mode) == 0o700
    values = dict(line.split("=", 1) for line in f.read_text().splitlines() if line and not line.startswith("#"))
    assert set(values) == {"EPDSERVE_CLUSTER_TOKEN", "EPDSERVE_API_KEY", "EPDSERVE_MEDIA_KEY_SECRET"}
    assert all(len(v) == 64 for v in values.values()) and len(set(values.values())) == 3
    assert not any(v in out.stdout + out.stderr for v in values.values())  # never printed
    assert _run(["check-env", "head"], env).returncode == 0
    before = f.read_text()
    assert "exists" in _one_line(_run(["new-env"], env)) and f.read_text() == before  # never overwritten


def test_insecure_needs_no_env_file_and_warns(env):
    out = _run(["check-env", "head"], dict(env, INSECURE="1"))
    assert out.returncode == 0, out.stderr
    assert "WARNING: INSECURE=1" in out.stderr and "no env file" in out.stdout
