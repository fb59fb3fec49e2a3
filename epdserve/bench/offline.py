"""`epdserve bench offline`: the engine against transformers' generation paths, one run, side by side.

Owns the command (`add_parser` / `run`): resolve the model (default: the small demo checkpoint,
built once into a cache directory), run every configuration of every chosen workload in its own
worker process (`offline_worker`), then print the Markdown table and write the JSON report
(`offline_report`). Absolute times depend on the machine; the ratios are the result.
"""
from __future__ import annotations

import argparse
import json
import os
import pathlib
import subprocess
import sys
import tempfile
import time

from epdserve.bench.offline_report import markdown, summarize_workload
from epdserve.bench.offline_workloads import DEFAULTS, WORKLOADS, WorkloadSpec
from epdserve.deploy.local.procs import die_with_parent

BASELINES = {"text": ["engine_portable", "one_at_a_time", "padded", "generate_batch"],
             "images": ["engine_portable", "one_at_a_time", "padded"]}


def add_parser(subparsers) -> argparse.ArgumentParser:
    p = subparsers.add_parser(
        "offline",
        help="offline throughput: epdserve engine vs transformers generate (1 at a time, padded batches, generate_batch)",
        description=(
            "Measures offline throughput (output and total tokens/s), peak RSS and the engine's time split "
            "(vision / prefill / decode; host (Python) time per step apart from the forward) for the epdserve "
            "engine (LLM.generate, all requests at once; native paged operators unless --engine-arg ops=portable) "
            "against the same engine on the portable paged operators, "
            "transformers generate one request at a time, generate on left-padded batches of 8 and, for "
            "text-only, transformers' continuous batching (generate_batch). Each configuration runs in its own "
            "process on the same seeded requests with the same number of output tokens (EOS ignored); greedy "
            "outputs are checked against one-at-a-time generate. Workloads: text (64 requests, prompts of "
            "50-400 tokens, 128 output tokens) and images (32 requests with one 448x448 JPEG, 64 output tokens)."
        ),
    )
    p.add_argument("--model", metavar="DIR", help="checkpoint directory (default: build the small demo model into a cache dir)")
    p.add_argument("--arch", choices=("qwen2_vl", "qwen2_5_vl"), default="qwen2_vl",
                   help="architecture of the default demo model (ignored with --model)")
    p.add_argument("--workload", choices=(*WORKLOADS, "all"), default="all", help="which workload(s) to run (default: all)")
    p.add_argument("--num-requests", type=int, help="requests per workload (default: text 64, images 32)")
    p.add_argument("--output-len", type=int, help="output tokens per request (default: text 128, images 64)")
    p.add_argument("--min-prompt-len", type=int, default=50, help="text workload: shortest prompt in tokens")
    p.add_argument("--max-prompt-len", type=int, default=400, help="text workload: longest prompt in tokens")
    p.add_argument("--image-size", type=int, default=448, help="images workload: image side in pixels")
    p.add_argument("--out", default="bench-offline.json", help="JSON report path (default: bench-offline.json)")
    p.add_argument("--threads", type=int, default=2, help="torch threads per configuration")
    p.add_argument("--seed", type=int, default=0, help="workload seed")
    p.add_argument("--skip-baselines", action="store_true", help="run the engine only (no ratios, no token check)")
    p.add_argument("--baseline-requests", type=int, metavar="N",
                   help="run the slow one-at-a-time baseline on the first N requests only; its tok/s is over "
                        "those N (marked 'subset' in the table) and the token check covers them")
    p.add_argument("--repeats", type=int, default=1,
                   help="run every configuration R times, interleaved (A B C A B C ...), and report medians")
    p.add_argument("--engine-arg", action="append", default=[], metavar="KEY=VALUE",
                   help="extra EngineConfig field for the engine run, e.g. max_num_batched_tokens=4096 (repeatable)")
    p.set_defaults(func=run)
    return p


def run(args: argparse.Namespace) -> int:
    if args.repeats < 1 or args.threads < 1 or (args.baseline_requests is not None and args.baseline_requests < 1):
        raise SystemExit("--repeats, --threads and --baseline-requests must be >= 1")
    model_dir = pathlib.Path(args.model) if args.model else default_model(args.arch)
    workloads = list(WORKLOADS) if args.workload == "all" else [args.workload]
    engine_args = dict(parse_kv(kv) for kv in args.engine_arg)
    engine_args.setdefault("dtype", "float32")  # transformers' side runs fp32 (offline_configs): the same here
    report = {
        "benchmark": "offline", "model": str(model_dir), "model_name": model_dir.name,
        "threads": args.threads, "cpu_count": os.cpu_count(), "repeats": args.repeats, "seed": args.seed,
        "engine_args": engine_args, "baseline_requests": args.baseline_requests, "started": time.strftime("%Y-%m-%dT%H:%M:%S"),
        "workloads": {},
    }
    with tempfile.TemporaryDirectory(prefix="epdserve-bench-") as tmp:
        for name in workloads:
            n_default, out_default = DEFAULTS[name]
            spec = WorkloadSpec(name, args.num_requests or n_default, args.output_len or out_default, args.seed,
                                args.min_prompt_len, args.max_prompt_len, args.image_size)
            runs = _run_workload(tmp, spec, model_dir, args, engine_args)
            report["workloads"][name] = {"spec": spec.to_dict(), **summarize_workload(name, runs, spec.num_requests)}
    from epdserve.bench.offline_configs import LABELS  # torch: not imported for --help

    text = markdown(report, LABELS)
    print(text)
    out = pathlib.Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    report["markdown"] = text
    out.write_text(json.dumps(report, indent=2) + "\n")
    _log(f"wrote {out}")
    return 0


def _run_workload(tmp: str, spec: WorkloadSpec, model_dir, args, engine_args: dict) -> dict[str, list[dict]]:
    """Every configuration `args.repeats` times, interleaved; config name → worker results."""
    configs = ["engine"] + ([] if args.skip_baselines else BASELINES[spec.name])
    runs: dict[str, list[dict]] = {cfg: [] for cfg in configs}
    for rep in range(args.repeats):
        for cfg in configs:
            subset = args.baseline_requests if cfg == "one_at_a_time" else None
            tag = f"[{spec.name} {rep + 1}/{args.repeats}] {cfg}"
            _log(f"{tag}: running {subset or spec.num_requests} requests ...")
            r = _run_worker(tmp, cfg, model_dir, spec, args.threads, subset, engine_args)
            runs[cfg].append(r)
            _log(f"{tag}: {r['output_tokens']} tokens in {r['duration_s']:.1f} s "
                 f"({r['output_tokens'] / r['duration_s']:.1f} out tok/s), peak RSS "
                 f"{r['peak_rss_bytes'] / 2**20:.0f} MiB, load {r['loadavg_1m'][1]:.1f}")
    return runs


def default_model(arch: str, size: str = "small") -> pathlib.Path:
    """A demo checkpoint in the user's cache dir, built on first use (model/demo_cache.py)."""
    from epdserve.model.demo_cache import cached_demo_model, demo_model_path

    if not (demo_model_path(arch, size) / "model.safetensors").is_file():
        _log(f"building the {size} {arch} demo model into {demo_model_path(arch, size)} (once) ...")
    return cached_demo_model(arch, size)


def _run_worker(tmp: str, cfg: str, model_dir, spec: WorkloadSpec, threads: int, subset, engine_args) -> dict:
    from epdserve.bench.offline_worker import WorkerJob

    job = WorkerJob(cfg, str(model_dir), spec.to_dict(), threads, subset, engine_args if cfg == "engine" else {})
    job_path = pathlib.Path(tmp) / f"{spec.name}-{cfg}.job.json"
    out_path = pathlib.Path(tmp) / f"{spec.name}-{cfg}.result.json"
    job_path.write_text(job.to_json())
    env = dict(os.environ, OMP_NUM_THREADS=str(threads), MKL_NUM_THREADS=str(threads), TOKENIZERS_PARALLELISM="false")
    pkg_root = str(pathlib.Path(__file__).resolve().parents[2])
    env["PYTHONPATH"] = os.pathsep.join(p for p in (pkg_root, env.get("PYTHONPATH")) if p)
    proc = subprocess.run([sys.executable, "-m", "epdserve.bench.offline_worker", str(job_path), str(out_path)], env=env,
                          preexec_fn=die_with_parent())  # a killed benchmark leaves no worker behind
    if proc.returncode != 0 or not out_path.is_file():
        raise RuntimeError(f"{spec.name}/{cfg} worker failed (exit {proc.returncode})")
    return json.loads(out_path.read_text())


def parse_kv(kv: str) -> tuple[str, object]:
    """`--engine-arg KEY=VALUE` → (key, value as int, float, bool or str)."""
    key, sep, value = kv.partition("=")
    if not sep:
        raise SystemExit(f"--engine-arg wants KEY=VALUE, got {kv!r}")
    for conv in (int, float):
        try:
            return key, conv(value)
        except ValueError:
            pass
    return key, {"true": True, "false": False}.get(value.lower(), value)


def _log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="epdserve bench")
    add_parser(parser.add_subparsers(dest="benchmark", required=True))
    args = parser.parse_args(["offline", *(sys.argv[1:] if argv is None else argv)])
    return args.func(args)
