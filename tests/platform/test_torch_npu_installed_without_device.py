"""A host where torch_npu is installed but cannot load (no CANN / driver), simulated with a stub
package that registers torch's backend entry point exactly as torch_npu's setup.py does
(`torch.backends: torch_npu = torch_npu:_autoload`) and fails where the real one fails: while
loading its C extension, after `import torch` (torch_npu/__init__.py sets
TORCH_DEVICE_BACKEND_AUTOLOAD=0 first, then imports torch, then its core modules).

Plain `import torch` then raises (torch's `_import_device_backends` wraps the error); epdserve
must still import, pick the CPU with the real reason logged once, refuse `device="npu"` with that
reason, and its platform tests must pass there.
"""
import os
import subprocess
import sys
from pathlib import Path

import pytest

STUB_INIT = '''import os
ORG_AUTOLOAD = os.getenv("TORCH_DEVICE_BACKEND_AUTOLOAD", "1")
os.environ["TORCH_DEVICE_BACKEND_AUTOLOAD"] = "0"
import torch  # noqa: E402,F401
raise ImportError("libhccl.so: cannot open shared object file: No such file or directory")


def _autoload():
    os.environ["TORCH_DEVICE_BACKEND_AUTOLOAD"] = ORG_AUTOLOAD
'''


@pytest.fixture(scope="module")
def stub_site(tmp_path_factory) -> Path:
    site = tmp_path_factory.mktemp("site")
    (site / "torch_npu").mkdir()
    (site / "torch_npu" / "__init__.py").write_text(STUB_INIT)
    dist = site / "torch_npu-2.12.0.dist-info"
    dist.mkdir()
    (dist / "METADATA").write_text("Metadata-Version: 2.1\nName: torch_npu\nVersion: 2.12.0\n")
    (dist / "entry_points.txt").write_text("[torch.backends]\ntorch_npu = torch_npu:_autoload\n")
    return site


def _run(site: Path, *args: str, autoload: str | None = None) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k != "TORCH_DEVICE_BACKEND_AUTOLOAD"}
    env["PYTHONPATH"] = os.pathsep.join([str(site), str(Path(__file__).resolve().parents[2])])
    if autoload is not None:
        env["TORCH_DEVICE_BACKEND_AUTOLOAD"] = autoload
    return subprocess.run([sys.executable, *args], env=env, capture_output=True, text=True, timeout=300)


def test_the_stub_breaks_plain_torch_import_like_the_real_package(stub_site):
    r = _run(stub_site, "-c", "import torch")
    assert r.returncode != 0 and "Failed to load the backend extension: torch_npu" in r.stderr


def test_epdserve_imports_runs_on_cpu_and_says_why(stub_site):
    code = ("import logging; logging.basicConfig()\n"
            "import epdserve\n"
            "from epdserve.platform import get_platform\n"
            "print(get_platform('auto').name, get_platform('auto').name)\n"
            "try:\n    get_platform('npu')\nexcept RuntimeError as e:\n    print('refused:', e)\n")
    r = _run(stub_site, "-c", code)
    assert r.returncode == 0, r.stderr
    assert "cpu cpu" in r.stdout
    assert "refused:" in r.stdout and "libhccl.so" in r.stdout
    assert r.stderr.count("torch_npu is installed but the NPU cannot be used") == 1 and "libhccl.so" in r.stderr


def test_platform_tests_pass_there(stub_site):
    r = _run(stub_site, "-m", "pytest", "-q", "-p", "no:cacheprovider", "tests/platform/test_platform.py")
    assert r.returncode == 0, r.stdout[-2000:]
