"""checkov's Kubernetes checks over every mode x flavour's manifests: none may fail but the
skips below, each with its reason.

checkov runs from a virtual environment of its own, made once per checkov version under the
cache folder (`$EPDSERVE_CACHE_DIR`, else `~/.cache/epdserve`): installed into the test
environment it would downgrade packages epdserve uses (pip's plan for checkov 3.3.30 takes
packaging to 23.2, cachetools to 5.5.2, networkx to 2.6.3), and it brings ~100 packages
(~70 s on a 2-core machine, 290 MB). Offline, its severities are unknown (they come from its
vendor's service), so instead of "no failed high-severity check" the rule is stricter: no failed
check at all outside SKIPS. Where the venv cannot be made (no package index), the test is skipped
and says so, except under CI=true, where that fails.

The manifests are rendered as a production release would be: images pinned by digest and
pulled Always (the try-out defaults, `epdserve:cpu` with IfNotPresent, fail CKV_K8S_43 / 15).
"""
from __future__ import annotations

import fcntl
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from epdserve.deploy.kube.render import render, to_yaml
from epdserve.deploy.kube.values import KubeValues
from tests.kube.conftest import CASES

CHECKOV = "checkov==3.3.30"
DIGEST = "@sha256:" + "0" * 64
SKIPS = {
    # epdserve reads the cluster token and the MM Store password only from the environment
    # (`epdserve instance` has no file flag for them); env from a secretKeyRef keeps them out of
    # the pod spec and out of argv (`ps`), which is the leak this check is about.
    "CKV_K8S_35": "secrets as environment variables",
    # torch's C++-extension loader writes a lock file and build.ninja into the operators' build
    # folder (made at image build by `epdserve build-ops`) even when the library is built, so
    # epdserve's containers need a writable root filesystem; the Redis container has a read-only one.
    "CKV_K8S_22": "read-only root filesystem",
}


def _cache() -> Path:
    base = os.environ.get("EPDSERVE_CACHE_DIR") or Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") \
        / "epdserve"
    return Path(base) / ("venv-" + CHECKOV.replace("==", "-"))


def checkov_bin() -> Path:
    """The venv's checkov, made under a file lock (concurrent test runs share one) and marked
    complete only once pip succeeded."""
    venv = _cache()
    done = venv / ".complete"
    venv.parent.mkdir(parents=True, exist_ok=True)
    try:
        with open(venv.parent / (venv.name + ".lock"), "w") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            if not done.exists():
                shutil.rmtree(venv, ignore_errors=True)  # a half-made one from an interrupted run
                subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True, capture_output=True)
                r = subprocess.run([str(venv / "bin" / "python"), "-m", "pip", "install", "-q", CHECKOV],
                                   capture_output=True, text=True, timeout=900)
                if r.returncode:
                    raise RuntimeError(f"pip install {CHECKOV} failed: {r.stderr[-2000:]}")
                done.touch()
    except (OSError, RuntimeError, subprocess.SubprocessError) as e:
        if os.environ.get("CI") == "true":
            raise
        pytest.skip(f"no checkov venv: {e}")
    return venv / "bin" / "checkov"


def production(mode: str, flavour: str) -> KubeValues:
    return KubeValues(mode=mode, flavour=flavour, encode=2, secrets="generate", image=f"registry.example/epdserve{DIGEST}",
                      mm_store_image=f"redis{DIGEST}", image_pull_policy="Always")


@pytest.mark.slow
def test_checkov_finds_no_failed_check_beyond_the_justified_skips(tmp_path):
    exe = checkov_bin()
    for mode, flavour in CASES:
        (tmp_path / f"{mode}-{flavour}.yaml").write_text(to_yaml(render(production(mode, flavour))))
    r = subprocess.run([str(exe), "-d", str(tmp_path), "--framework", "kubernetes", "--skip-download", "--quiet",
                        "--compact", "-o", "json", "--skip-check", ",".join(SKIPS)],
                       capture_output=True, text=True, timeout=600)
    reports = json.loads(r.stdout)
    reports = reports if isinstance(reports, list) else [reports]
    failed = [f"{f['check_id']} {f['check_name']}: {f['resource']} ({Path(f['file_path']).name})"
              for rep in reports for f in rep["results"]["failed_checks"]]
    assert reports[0]["summary"]["passed"] > 0 and reports[0]["summary"]["parsing_errors"] == 0, r.stderr[-2000:]
    assert not failed, "\n".join(failed)
