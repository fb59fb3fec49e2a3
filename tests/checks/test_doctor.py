"""`epdserve doctor` on CPU against real servers: a running MM Store and scheduler answer (ok), a
closed port does not (exit 1 with the fix line); `--mode E-P-D` passes when nothing is missing;
a torch_npu that does not match torch fails through the real entry point."""
from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

from epdserve.entrypoints.cli import main
from epdserve.checks.doctor import Status, cann_version, run_checks
from epdserve.checks.npu.pins import npu_fix
from epdserve.net import free_port
from epdserve.scheduler import SchedulerConfig, SchedulerThread
from epdserve.transfer.mm_store import LocalRedisServer


def doctor(capsys, *args) -> tuple[int, str]:
    rc = main(["doctor", "--timeout", "1", *args])
    return rc, capsys.readouterr().out


def row(out: str, name: str) -> str:
    return next(line for line in out.splitlines() if line.startswith(name + " "))


@pytest.fixture
def empty_ops_cache(tmp_path, monkeypatch):
    """No native build cached: the native-ops row warns (it never builds)."""
    monkeypatch.setenv("EPDSERVE_OPS_CACHE", str(tmp_path / "ops"))
    monkeypatch.delenv("EPDSERVE_OPS", raising=False)


def test_table_and_mode_on_cpu_passes_with_warnings(capsys, empty_ops_cache):
    rc, out = doctor(capsys, "--mode", "E-P-D", "--device", "cpu")
    assert rc == 0, out
    for name in ("torch", "torch_npu", "CANN", "CUDA", "devices", "mode", "dist backend", "native ops",
                 "HCCL/Gloo env", "MM Store", "scheduler"):
        assert row(out, name)
    assert "gloo" in row(out, "dist backend") and " ok " in row(out, "dist backend")
    assert "KV hop P->D over gloo" in row(out, "mode")
    assert "launch starts a private server" in row(out, "MM Store")
    assert " warn " in row(out, "native ops") and "fix native ops: epdserve build-ops" in out
    assert "0 fail" in out


def test_mm_store_answers_and_closed_port_fails(capsys):
    with LocalRedisServer() as server:
        rc, out = doctor(capsys, "--mm-store", server.url)
    assert rc == 0, out
    assert f"{server.url} answers" in row(out, "MM Store")

    url = f"redis://127.0.0.1:{free_port()}"  # nobody listens there
    rc, out = doctor(capsys, "--mode", "E-P-D", "--mm-store", url)
    assert rc == 1
    assert " fail " in row(out, "MM Store") and "does not answer" in row(out, "MM Store")
    assert f"fix MM Store: start a Redis/Valkey server at {url}" in out

    rc, out = doctor(capsys, "--mm-store", "http://127.0.0.1:1")
    assert rc == 1 and "must start with one of redis://" in row(out, "MM Store")


def test_scheduler_answers_and_unreachable_fails(capsys, qwen2_vl_tiny):
    with SchedulerThread(SchedulerConfig(model=str(qwen2_vl_tiny), port=free_port(), mode="E-P-D")) as sched:
        rc, out = doctor(capsys, "--scheduler", f"grpc://{sched.address}", "--mode", "E-P-D")
        assert rc == 0, out
        assert f"{sched.address} answers" in row(out, "scheduler") and "mode E-P-D" in row(out, "scheduler")
        rc, out = doctor(capsys, "--scheduler", sched.address, "--mode", "EP-D")  # another mode: a warning
        assert rc == 0 and " warn " in row(out, "scheduler") and "fix scheduler: this scheduler serves E-P-D" in out

    rc, out = doctor(capsys, "--scheduler", f"127.0.0.1:{free_port()}")
    assert rc == 1
    assert " fail " in row(out, "scheduler") and "fix scheduler: start it" in out


def test_cann_version_from_toolkit_info(tmp_path):
    info = tmp_path / "x86_64-linux" / "ascend_toolkit_install.info"
    info.parent.mkdir()
    info.write_text("package_name=Ascend-cann-toolkit\nversion=8.0.RC2\ninnerversion=V100R001C18\n")
    assert cann_version([str(tmp_path)]) == ("8.0.RC2", str(tmp_path))
    assert cann_version([str(tmp_path / "missing")]) is None


def test_device_not_present_fails():
    checks = {c.name: c for c in run_checks(device="npu")}
    assert checks["devices"].status is Status.FAIL and checks["devices"].fix
    assert "dist backend" not in checks  # nothing to check it on


def test_mismatched_torch_npu_fails_through_the_command(tmp_path):
    """A stub torch_npu whose version is not torch's: exit 1, the matching pip line as the fix."""
    (tmp_path / "torch_npu").mkdir()
    (tmp_path / "torch_npu" / "__init__.py").write_text("")
    dist = tmp_path / "torch_npu-1.0.0.dist-info"
    dist.mkdir()
    (dist / "METADATA").write_text("Metadata-Version: 2.1\nName: torch_npu\nVersion: 1.0.0\n")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(tmp_path), os.environ.get("PYTHONPATH", "")]),
           "ASCEND_HOME_PATH": str(tmp_path / "no-cann")}
    proc = subprocess.run([sys.executable, "-m", "epdserve.entrypoints.cli", "doctor", "--device", "cpu"],
                          capture_output=True, text=True, env=env, timeout=120)
    assert proc.returncode == 1, proc.stdout + proc.stderr
    release = ".".join(torch.__version__.split("+")[0].split(".")[:3])
    assert "1.0.0 does not match torch" in row(proc.stdout, "torch_npu")
    assert f"fix torch_npu: {npu_fix(release)}" in proc.stdout and f"=={release}.*" not in proc.stdout
    if cann_version() is None:  # torch_npu is installed, so CANN is needed
        assert " fail " in row(proc.stdout, "CANN")


def test_mm_store_refusing_the_password_names_where_it_is(capsys, monkeypatch, tmp_path):
    monkeypatch.delenv("EPDSERVE_MM_STORE_PASSWORD", raising=False)
    with LocalRedisServer(password="doctor-store-secret") as server:  # as launch's private store
        rc, out = doctor(capsys, "--mm-store", server.address_url)  # the URL the ready line prints: no password
        assert rc == 1 and " fail " in row(out, "MM Store") and "refuses the password" in row(out, "MM Store")
        assert ("fix MM Store: it needs a password: set EPDSERVE_MM_STORE_PASSWORD (or put it in the URL); for "
                "`epdserve launch`'s private MM Store it is in the file its ready line names") in out
        monkeypatch.setenv("EPDSERVE_MM_STORE_PASSWORD", "not-the-password")
        rc, out = doctor(capsys, "--mm-store", server.address_url)
        assert rc == 1 and "fix MM Store: a wrong password was given: set EPDSERVE_MM_STORE_PASSWORD" in out
        monkeypatch.setenv("EPDSERVE_MM_STORE_PASSWORD", "doctor-store-secret")
        rc, out = doctor(capsys, "--mm-store", server.address_url)
        assert rc == 0 and " ok " in row(out, "MM Store"), out
    assert "doctor-store-secret" not in out


def test_scheduler_answering_unauthenticated_says_set_the_api_key(capsys, monkeypatch, qwen2_vl_tiny):
    from epdserve.security import Secret
    from epdserve.security.options import SchedulerSecurity

    monkeypatch.delenv("EPDSERVE_API_KEY", raising=False)
    security = SchedulerSecurity(api_key=Secret("doctor-api-key"))
    with SchedulerThread(SchedulerConfig(model=str(qwen2_vl_tiny), port=0), security=security) as sched:
        rc, out = doctor(capsys, "--scheduler", sched.address)
        assert rc == 1 and "UNAUTHENTICATED" in row(out, "scheduler")
        assert "fix scheduler: set EPDSERVE_API_KEY (the deployment's API key) and run doctor again" in out
        assert "start it" not in out
        monkeypatch.setenv("EPDSERVE_API_KEY", "doctor-api-key")
        rc, out = doctor(capsys, "--scheduler", sched.address)
        assert rc == 0 and f"{sched.address} answers" in row(out, "scheduler"), out


def test_tensor_parallel_degree_is_checked_against_the_model(capsys, qwen2_vl_tiny):
    rc, out = doctor(capsys, "--device", "cpu", "--tensor-parallel-size", "3", "--model", str(qwen2_vl_tiny))
    assert rc == 1, out
    assert " fail " in row(out, "tensor parallel") and "valid degrees: 1, 2, 4" in row(out, "tensor parallel")
    rc, out = doctor(capsys, "--device", "cpu", "--tensor-parallel-size", "2", "--model", str(qwen2_vl_tiny))
    assert rc == 0 and " fail " not in row(out, "tensor parallel"), out


def test_quantization_row_says_which_linears_and_refuses_a_platform_without_the_kernel(capsys):
    from types import SimpleNamespace

    from epdserve.checks.doctor import Status, _quantization

    rc, out = doctor(capsys, "--device", "cpu", "--quantization", "int8")
    assert rc == 0 and " ok " in row(out, "quantization") and "attention and MLP linears, MoE experts included" in \
        row(out, "quantization")
    check = _quantization(SimpleNamespace(name="npu"), "fp8")  # only the platform's name is read
    assert check.status is Status.FAIL and "runs on cpu, cuda only" in check.detail, check
    check = _quantization(SimpleNamespace(name="cuda"), "w8a8")
    assert check.status is Status.FAIL and "runs on cpu, npu only" in check.detail, check
    assert _quantization(SimpleNamespace(name="cuda"), "int8").status is Status.OK  # no GPU here: the kernel unrun


@pytest.mark.parametrize("method, absent, status", [
    ("w8a8", (), "ok"), ("w8a8", ("npu_dynamic_quant",), "fail"),
    ("int4", (), "ok"), ("int4", ("npu_convert_weight_to_int4pack",), "fail")])
def test_quantization_row_on_an_npu_reads_the_installed_torch_npus_operators(monkeypatch, method, absent, status):
    from types import SimpleNamespace

    from epdserve.checks.doctor import _quantization
    from tests.fakes.torch_npu_fake import FakeTorchNpu

    FakeTorchNpu(absent=absent).install(monkeypatch)
    check = _quantization(SimpleNamespace(name="npu"), method)
    assert check.status.value == status, check
    assert status == "ok" or f"torch_npu.{absent[0]}" in check.detail


def test_the_quantization_row_refuses_fp8_on_a_cuda_device_below_8_9(monkeypatch):
    from types import SimpleNamespace

    from epdserve.checks.doctor import Status, _quantization

    monkeypatch.setattr(torch.cuda, "get_device_name", lambda *a: "NVIDIA A100-SXM4-80GB")
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda *a: (8, 0))
    check = _quantization(SimpleNamespace(name="cuda"), "fp8")
    assert check.status is Status.FAIL and "compute capability >= 8.9" in check.detail and "has 8.0" in check.detail
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda *a: (9, 0))
    assert _quantization(SimpleNamespace(name="cuda"), "compressed-tensors").status is Status.OK


def test_quantization_row_with_a_model_refuses_int4_experts_that_are_not_whole_groups(capsys, qwen3_vl_moe_tiny):
    rc, out = doctor(capsys, "--device", "cpu", "--quantization", "int4", "--model", str(qwen3_vl_moe_tiny))
    assert rc == 1 and " fail " in row(out, "quantization"), out
    assert "MoE experts' gate_up_proj (hidden_size) takes 64 and down_proj (moe_intermediate_size) takes 32" in out
    rc, out = doctor(capsys, "--device", "cpu", "--quantization", "int8", "--model", str(qwen3_vl_moe_tiny))
    assert rc == 0 and " ok " in row(out, "quantization"), out


def test_the_dtype_row_says_what_auto_runs_here_and_why(capsys, monkeypatch):
    from epdserve.platform.dtype_default import auto_dtype

    monkeypatch.delenv("EPDSERVE_DTYPE", raising=False)
    rc, out = doctor(capsys, "--device", "cpu")
    name, why = auto_dtype("cpu")
    assert f"{name} ({why})" in row(out, "dtype")
    monkeypatch.setenv("EPDSERVE_DTYPE", "float16")
    rc, out = doctor(capsys, "--device", "cpu")
    assert "float16 ($EPDSERVE_DTYPE)" in row(out, "dtype")
