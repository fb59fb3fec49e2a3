"""`--dtype auto` (issue 50 item 4): bf16 on a CPU whose flags say it computes bf16 natively, fp32 on
one that does not (the detection stubbed at the CPU flags: a cpuinfo file), bf16 on accelerators;
$EPDSERVE_DTYPE fills a dtype not given (how the suite keeps fp32: tests/conftest.py); launch
resolves auto once and hands every instance the result; an engine loaded with auto says why."""
from __future__ import annotations

import torch

from epdserve import LLM
from epdserve.deploy.local.deployment import Deployment, DeploymentSpec
from epdserve.engine.config import EngineConfig
from epdserve.instance.config import InstanceConfig
from epdserve.platform.dtype_default import auto_dtype, cpu_flags, resolve_dtype

XEON = "processor\t: 0\nflags\t\t: fpu sse2 avx2 avx512f avx512_bf16 avx512_fp16 amx_bf16 amx_tile\n"
OLD = "processor\t: 0\nflags\t\t: fpu sse2 avx2 avx512f\n"


def test_auto_is_bf16_only_on_a_cpu_with_native_bf16(tmp_path):
    (tmp_path / "xeon").write_text(XEON)
    (tmp_path / "old").write_text(OLD)
    assert cpu_flags(tmp_path / "old") == {"fpu", "sse2", "avx2", "avx512f"}
    assert cpu_flags(tmp_path / "missing") == set()
    dtype, why = auto_dtype("cpu", cpu_flags(tmp_path / "xeon"))
    assert dtype == "bfloat16" and why == "auto: this CPU has AVX512-BF16 and AMX-BF16"
    assert auto_dtype("cpu", {"amx_bf16"})[0] == "bfloat16"
    dtype, why = auto_dtype("cpu", cpu_flags(tmp_path / "old"))
    assert dtype == "float32" and "no AVX512-BF16" in why
    assert auto_dtype("npu", set()) == ("bfloat16", "auto: bf16 on npu")
    assert resolve_dtype("float16", "cpu", {"avx512_bf16"}) == ("float16", "--dtype")
    assert resolve_dtype(None, "cpu", set())[0] == resolve_dtype("auto", "cpu", set())[0] == "float32"


def test_the_environment_fills_a_dtype_not_given(monkeypatch):
    monkeypatch.setenv("EPDSERVE_DTYPE", "bfloat16")
    assert EngineConfig(model="m").dtype == "bfloat16"
    assert EngineConfig(model="m", dtype="float32").dtype == "float32"
    assert InstanceConfig(roles="EPD", model="m").dtype == "bfloat16"
    monkeypatch.delenv("EPDSERVE_DTYPE")
    assert EngineConfig(model="m").dtype is None and InstanceConfig(roles="EPD", model="m").dtype is None


def test_launch_resolves_auto_once_for_every_instance(monkeypatch):
    monkeypatch.delenv("EPDSERVE_DTYPE")
    here = auto_dtype("cpu")[0]
    d = Deployment(DeploymentSpec(mode="E-P-D", model="m", device="cpu"))
    assert d.dtype == here
    argv = d._instance_argv("D")
    assert argv[argv.index("--dtype") + 1] == here
    d = Deployment(DeploymentSpec(mode="E-P-D", model="m", device="cpu", instance_args=["--dtype", "float16"]))
    assert d.dtype == "float16"


def test_an_engine_loaded_with_auto_runs_what_this_cpu_computes_fastest_and_says_why(qwen2_vl_tiny):
    llm = LLM(qwen2_vl_tiny, device="cpu", dtype="auto", kv_cache_bytes=4 << 20)
    want = torch.bfloat16 if {"avx512_bf16", "amx_bf16"} & cpu_flags() else torch.float32
    assert llm.engine.model.dtype == want and llm.engine.model.dtype_why.startswith("auto: ")
    assert llm.engine.kv_layout().dtype == str(want).removeprefix("torch.")
    llm.engine.close()
