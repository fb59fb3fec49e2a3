"""A second client's view: NVIDIA's aiperf (`aiperf profile`, its own venv) against vLLM and
epdserve on one checkpoint, one command (issue 50's aiperf aim):

    python benchmarks/aiperf_vs_vllm.py --rounds 2 --out $OUT/aiperf-vs-vllm.md

The workload is the issue's: streamed chat at a fixed concurrency (4), a fixed number of requests
(40), each with one synthetic 320x240 image (aiperf's noise source), a fixed output length
(`ignore_eos` through `--extra-inputs`), the same random seed for every target. Targets run one after
another, never two at once, alternating their order between rounds: vLLM as `epdserve/bench/
peer_vllm.py` serves it (its CPU docs' environment) and each epdserve `--modes` entry launched with
its HTTP front (`MODE#NAME` variants take `--mode-arg`, as vs_transformers_serve.py's do). The
report: per target the median over rounds (min-max) of aiperf's TTFT p50, inter-token latency p50,
request latency p50 and output tok/s, read from its `profile_export_aiperf.json`, and each epdserve
target's per-round ratio to vLLM's.

aiperf's venv: `--aiperf-venv` (default `$XDG_CACHE_HOME/epdserve/peer-aiperf`, built on first use:
`pip install aiperf==0.13.*`).
"""
from __future__ import annotations

import argparse
import json
import os
import pathlib
import shlex
import statistics
import subprocess
import sys
import tempfile

AIPERF_VERSION = "0.13.*"
FIGURES = (("time_to_first_token", "TTFT p50 ms", "p50"), ("inter_token_latency", "ITL p50 ms", "p50"),
           ("request_latency", "request latency p50 ms", "p50"), ("output_token_throughput", "output tok/s", "avg"))


def default_aiperf_venv() -> pathlib.Path:
    root = pathlib.Path(os.environ.get("XDG_CACHE_HOME") or pathlib.Path.home() / ".cache")
    return root / "epdserve" / "peer-aiperf"


def ensure_aiperf(venv: pathlib.Path) -> pathlib.Path:
    """aiperf's command in `venv`, the venv built once if it has none."""
    exe = venv / "bin" / "aiperf"
    if not exe.exists():
        python = getattr(sys, "_base_executable", None) or sys.executable
        subprocess.run([python, "-m", "venv", str(venv)], check=True)
        subprocess.run([str(venv / "bin" / "pip"), "install", "-q", f"aiperf=={AIPERF_VERSION}"], check=True)
    return exe


def aiperf_argv(exe: pathlib.Path, url: str, model: str, artifacts: pathlib.Path, a) -> list[str]:
    """One `aiperf profile` run of the workload against `url`."""
    return [str(exe), "profile", "--model", model, "--tokenizer", model, "--url", url, "--endpoint-type", "chat",
            "--streaming", "--concurrency", str(a.concurrency), "--request-count", str(a.requests),
            "--warmup-request-count", "2", "--image-width-mean", str(a.image_width),
            "--image-height-mean", str(a.image_height), "--image-batch-size", "1",
            "--prompt-input-tokens-mean", "48", "--prompt-output-tokens-mean", str(a.output_len),
            "--extra-inputs", json.dumps({"ignore_eos": True}),
            "--random-seed", "7", "--ui-type", "none", "--output-artifact-dir", str(artifacts)]


def read_figures(export: dict) -> dict[str, float]:
    """{figure label: value} from aiperf's `profile_export_aiperf.json`."""
    out = {}
    for key, label, stat in FIGURES:
        metric = export.get(key)
        if isinstance(metric, dict) and metric.get(stat) is not None:
            out[label] = float(metric[stat])
    return out


def _run_aiperf(exe: pathlib.Path, url: str, model: str, a, log) -> dict[str, float]:
    with tempfile.TemporaryDirectory(prefix="epdserve-aiperf-") as d:
        proc = subprocess.run(aiperf_argv(exe, url, model, pathlib.Path(d), a), capture_output=True, text=True,
                              timeout=a.timeout)
        exports = sorted(pathlib.Path(d).rglob("profile_export_aiperf.json"))
        if proc.returncode != 0 or not exports:
            raise RuntimeError(f"aiperf failed (exit {proc.returncode}): {(proc.stdout + proc.stderr)[-2000:]}")
        figures = read_figures(json.loads(exports[-1].read_text()))
    log(f"  {figures}")
    return figures


def _vllm(a, model: str, exe: pathlib.Path, log) -> dict[str, float]:
    from epdserve.bench.peer import peer_argv, serving
    from epdserve.bench.peer_vllm import VLLM_CMD, default_vllm_venv, ensure_vllm_venv, environ_with, vllm_env
    from epdserve.net import free_port

    venv = ensure_vllm_venv(pathlib.Path(a.vllm_venv) if a.vllm_venv else default_vllm_venv(), log)
    port = free_port()
    cmd = VLLM_CMD.replace("--dtype bfloat16", f"--dtype {a.dtype}")
    with serving(peer_argv(cmd, venv=venv, model=model, port=port), f"http://127.0.0.1:{port}/health", name="vllm",
                 env=environ_with(dict(os.environ), vllm_env(venv))):
        return _run_aiperf(exe, f"http://127.0.0.1:{port}", model, a, log)


def _epdserve(mode: str, a, model: str, exe: pathlib.Path, log) -> dict[str, float]:
    from epdserve.bench.vs_peer import http_url
    from epdserve.deploy.local.launched import launched, variant_args, variant_mode

    extra = ["--http-port", "0", "--instance-args", f"--dtype {a.dtype}", *variant_args(a.mode_arg).get(mode, [])]
    with launched(variant_mode(mode), model, extra, env={"OMP_WAIT_POLICY": "PASSIVE"}) as dep:
        return _run_aiperf(exe, http_url(dep.ready_line), model, a, log)


def report(rounds: list[dict[str, dict[str, float]]], a) -> str:
    """Medians over rounds per target and figure, and each epdserve target's per-round ratio to vLLM's."""
    def fmt(xs):
        return f"{statistics.median(xs):.1f} ({min(xs):.1f}-{max(xs):.1f})" if len(xs) > 1 else f"{xs[0]:.1f}"

    targets = list(rounds[0])
    labels = [label for _, label, _ in FIGURES]
    lines = [f"aiperf {AIPERF_VERSION}: {a.requests} streamed chat requests at concurrency {a.concurrency}, one "
             f"{a.image_width}x{a.image_height} image each, {a.output_len} output tokens, {a.dtype}; {len(rounds)} "
             "round(s), the targets' order alternating; each figure the median over rounds (min-max)", "",
             "| target | " + " | ".join(labels) + " |", "|---|" + "---:|" * len(labels)]
    for t in targets:
        lines.append(f"| {t} | " + " | ".join(fmt([r[t][x] for r in rounds]) for x in labels) + " |")
    lines += ["", "| target / vllm | " + " | ".join(labels) + " |", "|---|" + "---|" * len(labels)]
    for t in [t for t in targets if t != "vllm"]:
        cells = []
        for x in labels:
            ratios = [r[t][x] / r["vllm"][x] for r in rounds]
            cells.append(f"{statistics.median(ratios):.2f}x ({', '.join(f'{q:.2f}' for q in ratios)})")
        lines.append(f"| {t} | " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", help="checkpoint (default: the small demo Qwen2-VL, built once)")
    ap.add_argument("--modes", default="monolithic", help="epdserve targets, comma-separated (MODE or MODE#NAME)")
    ap.add_argument("--mode-arg", action="append", default=[], metavar="MODE#NAME=ARGS",
                    help="launch arguments of a MODE#NAME variant (repeatable)")
    ap.add_argument("--dtype", default="float32", help="both servers' dtype (default float32: this CPU's fast one)")
    ap.add_argument("--concurrency", type=int, default=4)
    ap.add_argument("--requests", type=int, default=40)
    ap.add_argument("--output-len", type=int, default=32)
    ap.add_argument("--image-width", type=int, default=320)
    ap.add_argument("--image-height", type=int, default=240)
    ap.add_argument("--rounds", type=int, default=2, help="rounds, the targets' order alternating")
    ap.add_argument("--aiperf-venv", help="aiperf's venv (default: built once under ~/.cache/epdserve)")
    ap.add_argument("--vllm-venv", help="vLLM's venv (default: peer_vllm's, built on first use)")
    ap.add_argument("--timeout", type=float, default=900.0, help="seconds one aiperf run may take")
    ap.add_argument("--out", help="write the Markdown report here too")
    a = ap.parse_args(argv)
    log = lambda m: print(m, flush=True)  # noqa: E731
    if a.model is None:
        from epdserve.model.demo_cache import cached_demo_model

        a.model = str(cached_demo_model("qwen2_vl", "small"))
    exe = ensure_aiperf(pathlib.Path(a.aiperf_venv) if a.aiperf_venv else default_aiperf_venv())
    runs = {"vllm": lambda: _vllm(a, a.model, exe, log),
            **{f"epdserve-{m}": (lambda m=m: _epdserve(m, a, a.model, exe, log)) for m in a.modes.split(",")}}
    rounds = []
    for i in range(a.rounds):
        order = list(runs) if i % 2 == 0 else list(reversed(runs))
        result = {}
        for t in order:
            log(f"round {i + 1}: {t} ({shlex.join(sys.argv[1:])})")
            result[t] = runs[t]()
        rounds.append({t: result[t] for t in runs})
    text = report(rounds, a)
    print(text)
    if a.out:
        pathlib.Path(a.out).write_text(text)
    return 0
