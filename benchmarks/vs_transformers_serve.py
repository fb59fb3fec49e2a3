"""epdserve against `transformers serve --continuous-batching` on the same workload, back to back
in one run, through the same OpenAI-compatible client (`epdserve bench serve --backend openai`).

    python benchmarks/vs_transformers_serve.py --model DIR --tvenv /path/to/venv \
        --modes monolithic,E-PD --out benchmarks/results/vs-transformers-serve.json

The peer needs its own venv (transformers' video/image processors want torchvision, which
epdserve's venv cannot have): torch 2.14.1 + torchvision 0.29.1 + transformers + fastapi +
uvicorn + openai + accelerate. transformers serve refuses vLLM's extra body fields, so every
target gets the plain OpenAI request (no ignore_eos: outputs may end at EOS). Each target serves the same seeded chat workload (by default 24 requests,
half with one image, 1 req/s, 32 output tokens); the targets run one after another, never at
once, and the merged report has one row per target with ratios against the peer.
"""
from __future__ import annotations

import argparse
import contextlib
import json
import os
import pathlib
import re
import signal
import subprocess
import sys
import time
import urllib.request

WORKLOAD = ["--workload", "sharegpt4o", "--num-requests", "24", "--text-only-share", "0.5",
            "--images-per-request", "1", "--request-rate", "1", "--output-len", "32", "--output-len-std", "0",
            "--seed", "0", "--no-progress"]
READY = re.compile(r"epdserve ready: .*http=(http://\S+)")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", required=True, help="checkpoint directory (both servers load it)")
    ap.add_argument("--tvenv", required=True, help="the peer's venv (bin/transformers)")
    ap.add_argument("--modes", default="monolithic,E-PD", help="epdserve modes to run (default monolithic,E-PD)")
    ap.add_argument("--launch-arg", default="", help="extra `epdserve launch` arguments for every mode")
    ap.add_argument("--out", default="vs-transformers-serve.json")
    ap.add_argument("--bench-arg", action="append", default=[], help="extra bench serve argument (repeatable)")
    a = ap.parse_args()
    out = pathlib.Path(a.out)
    parts: list[pathlib.Path] = []
    env = dict(os.environ, OMP_WAIT_POLICY="PASSIVE")
    with _peer(a.tvenv, a.model) as url:  # it refuses vLLM's extra fields: no ignore_eos for anyone
        parts.append(_bench(url, "transformers-serve", out, [*a.bench_arg, "--no-vllm-extras"], env))
    for mode in [m.strip() for m in a.modes.split(",") if m.strip()]:
        with _launched(mode, a.model, a.launch_arg, env) as url:
            parts.append(_bench(url, f"epdserve-{mode}", out, [*a.bench_arg, "--no-vllm-extras"], env))
    report = _merge([json.loads(p.read_text()) for p in parts])
    out.write_text(json.dumps(report, indent=1) + "\n")
    from epdserve.bench.report import markdown

    table = markdown(report, baseline="transformers-serve")
    out.with_suffix(".md").write_text(table + "\n")
    print(table)
    return 0


@contextlib.contextmanager
def _peer(tvenv: str, model: str):
    port = _free_port()
    cmd = [str(pathlib.Path(tvenv) / "bin" / "transformers"), "serve", "--continuous-batching", "--device", "cpu",
           "--dtype", "float32", "--port", str(port), model]
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    try:
        _wait_http(url + "/health", proc, 600)
        yield url
    finally:
        _stop(proc)


@contextlib.contextmanager
def _launched(mode: str, model: str, extra: str, env: dict):
    cmd = [sys.executable, "-m", "epdserve.entrypoints.cli", "launch", "--mode", mode, "--model", model,
           "--http-port", "0", *extra.split()]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env,
                            start_new_session=True)
    try:
        deadline = time.monotonic() + 600
        for line in proc.stdout:
            m = READY.search(line)
            if m:
                break
            if time.monotonic() > deadline:
                raise SystemExit(f"{mode}: no ready line")
        else:
            raise SystemExit(f"{mode}: launch exited before it was ready")
        yield m.group(1)
    finally:
        _stop(proc)


def _bench(url: str, label: str, out: pathlib.Path, extra: list[str], env: dict) -> pathlib.Path:
    part = out.with_name(f"{out.stem}-{label}.json")
    subprocess.run([sys.executable, "-m", "epdserve.entrypoints.cli", "bench", "serve", "--backend", "openai",
                    "--base-url", url, "--label", label, "--out", str(part), *WORKLOAD, *extra], check=True, env=env)
    return part


def _merge(reports: list[dict]) -> dict:
    merged = dict(reports[0])
    merged["targets"], merged["workloads"] = {}, {}
    for r in reports:
        merged["targets"].update(r.get("targets", {}))
        for name, w in r["workloads"].items():
            entry = merged["workloads"].setdefault(name, {k: v for k, v in w.items() if k != "modes"} | {"modes": {}})
            entry["modes"].update(w["modes"])
    return merged


def _wait_http(url: str, proc, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise SystemExit(f"{url}: the server exited ({proc.returncode})")
        try:
            with urllib.request.urlopen(url, timeout=2) as r:
                if r.status == 200:
                    return
        except OSError:
            time.sleep(1)
    raise SystemExit(f"{url} did not answer within {timeout_s:.0f} s")


def _stop(proc) -> None:
    if proc.poll() is None:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(10)


def _free_port() -> int:
    from epdserve.net import free_port

    return free_port()


if __name__ == "__main__":
    sys.exit(main())
