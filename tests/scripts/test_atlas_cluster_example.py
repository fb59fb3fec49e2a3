"""scripts/atlas_cluster_example.sh hands the env file to each server over ssh's stdin, never in
an argv, and refuses an unsafe env file or a password in MM_STORE before it runs any ssh.

`ssh` here is a stand-in on PATH that runs the remote command with bash as the server would:
with an empty environment (ssh forwards none) and HOME a folder per host; it logs every argv it
gets. The servers have no NPU, so the launch stops at their preflight, after the copy."""

import stat
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "scripts" / "atlas_cluster_example.sh"
TOKEN, KEY, REDIS_PW = "tok-7d1c0a9e5b", "key-3f8e21c4aa", "redis-pw-90b6e2"

FAKE_SSH = r"""#!/usr/bin/env bash
# ssh [-tt] HOST COMMAND: run COMMAND as on HOST (fresh environment, HOME=$FAKE_SSH_ROOT/HOST)
printf '%s\n' "$*" >> "$FAKE_SSH_ROOT/argv.log"
if [[ $1 == -tt ]]; then shift; fi
host=$1; shift
mkdir -p "$FAKE_SSH_ROOT/$host"
exec env -i HOME="$FAKE_SSH_ROOT/$host" PATH=/usr/bin:/bin bash -c "$*"
"""


@pytest.fixture
def login(tmp_path):
    """(env, env file, servers' root): a login node with a fake ssh and a good env file."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "ssh").write_text(FAKE_SSH)
    (bin_dir / "ssh").chmod(0o755)
    servers = tmp_path / "servers"
    servers.mkdir()
    env_file = tmp_path / "login" / ".epdserve" / "env"
    env_file.parent.mkdir(parents=True)
    env_file.write_text(f"EPDSERVE_CLUSTER_TOKEN={TOKEN}\nEPDSERVE_API_KEY={KEY}\nEPDSERVE_MM_STORE_PASSWORD={REDIS_PW}\n")
    env_file.chmod(0o600)
    env = {"PATH": f"{bin_dir}:/usr/bin:/bin", "HOME": str(tmp_path / "login"), "FAKE_SSH_ROOT": str(servers),
           "NODE_E": "atlas-01", "NODE_PD": "atlas-02", "HEAD_IP": "10.0.0.1", "PD_IP": "10.0.0.2", "REPO": str(ROOT),
           "MODEL": "/models/demo", "MM_STORE": "redis://10.0.0.5:6379/0"}
    return env, env_file, servers


def _run(env):
    return subprocess.run(["bash", str(SCRIPT)], env=env, capture_output=True, text=True, timeout=60)


def test_env_file_reaches_each_server_0600_and_never_an_argv(login):
    env, env_file, servers = login
    stale = servers / "atlas-02" / ".epdserve" / "env"
    stale.parent.mkdir(parents=True)
    stale.write_text("EPDSERVE_CLUSTER_TOKEN=old\n")
    stale.chmod(0o644)  # replaced whole, not rewritten in place with its loose mode
    out = _run(env)
    assert out.returncode == 1 and "preflight: npu-smi not found" in out.stderr, out.stderr  # after the copy
    for host in ("atlas-01", "atlas-02"):
        copy = servers / host / ".epdserve" / "env"
        want = env_file.read_text()
        if host == "atlas-02":  # instances only: no client API key there
            want = "".join(line for line in want.splitlines(keepends=True) if not line.startswith("EPDSERVE_API_KEY="))
        assert copy.read_text() == want
        assert stat.S_IMODE(copy.stat().st_mode) == 0o600
    assert stat.S_IMODE((servers / "atlas-01" / ".epdserve").stat().st_mode) == 0o700  # made by the copy
    argv = (servers / "argv.log").read_text()
    assert "atlas_node.sh preflight" in argv and "MODEL=/models/demo" in argv and "HEAD_IP=10.0.0.1" in argv
    assert not any(secret in argv for secret in (TOKEN, KEY, REDIS_PW))


def test_unsafe_env_file_stops_before_any_ssh(login):
    env, env_file, servers = login
    env_file.chmod(0o644)
    out = _run(env)
    assert out.returncode == 1 and "chmod 600" in out.stderr
    assert not (servers / "argv.log").exists()


def test_password_in_mm_store_stops_before_any_ssh(login):
    env, _, servers = login
    out = _run(dict(env, MM_STORE=f"redis://:{REDIS_PW}@10.0.0.5:6379/0"))
    assert out.returncode == 1 and "MM_STORE carries a password" in out.stderr
    assert REDIS_PW not in out.stderr and not (servers / "argv.log").exists()


def test_each_stages_degree_travels_to_the_servers_when_set(login):
    """Issue 48 item 1: TENSOR_PARALLEL_SIZE and ENCODE_/PREFILL_/DECODE_TENSOR_PARALLEL_SIZE reach
    atlas_node.sh on the servers when set here, and nothing of them when unset."""
    env, _, servers = login
    _run(dict(env, PREFILL_TENSOR_PARALLEL_SIZE="2", DECODE_TENSOR_PARALLEL_SIZE="4"))
    argv = (servers / "argv.log").read_text()
    assert "PREFILL_TENSOR_PARALLEL_SIZE=2" in argv and "DECODE_TENSOR_PARALLEL_SIZE=4" in argv
    assert "ENCODE_TENSOR_PARALLEL_SIZE" not in argv and " TENSOR_PARALLEL_SIZE" not in argv
