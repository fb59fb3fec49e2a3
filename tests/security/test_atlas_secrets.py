"""The Atlas scripts (issue 39): instances never hold the clients' API key, and no port binds a
guessed address. `atlas_node.sh instances` with an env file that holds EPDSERVE_API_KEY starts
`epdserve instance` (a fake that records its environment) without it; without NODE_IP it refuses,
where it used to bind the first `hostname -I` address (possibly a public one). The cluster
example's copy of the env file to an instance-only server lacks the key:
`tests/scripts/test_atlas_cluster_example.py`."""
from __future__ import annotations

import subprocess
from pathlib import Path

from tests.scripts.fake_atlas import make_fake_atlas

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "atlas_node.sh"
KEY = "sk-atlas-client-key-5d1e"
FAKE_EPDSERVE = """#!/bin/sh
env > "$FAKE_OUT/env"
"""


def _instances(tmp_path, **extra) -> subprocess.CompletedProcess:
    env = make_fake_atlas(tmp_path)
    (tmp_path / "bin" / "epdserve").write_text(FAKE_EPDSERVE)
    (tmp_path / "bin" / "epdserve").chmod(0o755)
    env_file = tmp_path / "secrets" / "env"
    env_file.parent.mkdir(mode=0o700)
    env_file.write_text(f"EPDSERVE_CLUSTER_TOKEN=tok-1\nEPDSERVE_API_KEY={KEY}\n")
    env_file.chmod(0o600)
    env.update(MODEL=str(tmp_path), HEAD_IP="127.0.0.1", NIC="lo", DEVICE="cpu", MM_STORE="redis://127.0.0.1:1/0",
               FAKE_OUT=str(tmp_path), EPDSERVE_ENV_FILE=str(env_file), **extra)
    return subprocess.run(["bash", str(SCRIPT), "instances", "P", "0"], env=env, capture_output=True, text=True,
                          timeout=60)


def test_instances_never_hold_the_client_api_key(tmp_path):
    out = _instances(tmp_path, NODE_IP="127.0.0.1")
    assert out.returncode == 0, out.stderr
    seen = (tmp_path / "env").read_text()
    assert "EPDSERVE_CLUSTER_TOKEN=tok-1" in seen and KEY not in seen


def test_instances_refuse_to_guess_their_address(tmp_path):
    out = _instances(tmp_path)
    assert out.returncode == 1 and "set NODE_IP" in out.stderr and not (tmp_path / "env").exists()
