"""Issue 24: a port beyond loopback without its credential refuses to start, in one line naming the
fix (the API key for public gRPC and HTTP, the cluster token for the internal and instance
ports, the key for /metrics); --insecure starts, with a warning."""
from __future__ import annotations

import subprocess
import sys
import time

import pytest

from tests.security.attack_harness import IP, KEY, clean_env, needs_ip

pytestmark = pytest.mark.slow


def _cli(*argv: str, env: dict, timeout: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "epdserve.entrypoints.cli", *argv], env=env, capture_output=True,
                          text=True, timeout=timeout)


@needs_ip
@pytest.mark.parametrize("argv, env, fix", [
    (["scheduler", "--host", IP], {}, "EPDSERVE_API_KEY"),
    (["scheduler", "--internal-host", IP], {"EPDSERVE_API_KEY": KEY}, "EPDSERVE_CLUSTER_TOKEN"),
    (["scheduler", "--http-port", "0", "--http-host", IP], {}, "EPDSERVE_API_KEY"),
    (["scheduler", "--metrics-port", "0", "--host", "127.0.0.1", "--http-host", IP], {}, "EPDSERVE_API_KEY"),
    (["instance", "--roles", "EPD", "--host", IP], {}, "EPDSERVE_CLUSTER_TOKEN"),
])
def test_a_port_beyond_loopback_without_its_credential_refuses_to_start(qwen2_vl_tiny, argv, env, fix):
    out = _cli(*argv[:1], "--model", str(qwen2_vl_tiny), *argv[1:], env=clean_env(**env))
    assert out.returncode == 2, out.stderr[-2000:]
    refusal = [line for line in out.stderr.splitlines() if "refusing to serve" in line]
    assert len(refusal) == 1 and fix in refusal[0] and "--insecure" in refusal[0], out.stderr[-2000:]


@needs_ip
def test_insecure_starts_with_a_warning(qwen2_vl_tiny, tmp_path):
    addr = tmp_path / "addr"
    proc = subprocess.Popen([sys.executable, "-m", "epdserve.entrypoints.cli", "scheduler", "--model",
                             str(qwen2_vl_tiny), "--host", IP, "--insecure", "--address-file", str(addr)],
                            env=clean_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        deadline = time.monotonic() + 120
        while not addr.exists():
            assert proc.poll() is None and time.monotonic() < deadline, proc.stdout.read() if proc.poll() else "slow"
            time.sleep(0.2)
    finally:
        proc.terminate()
        output = proc.communicate(timeout=30)[0]
    assert "WARNING" in output and "insecure" in output
