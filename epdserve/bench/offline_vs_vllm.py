"""The step itself against vLLM's: offline decode TPOT of epdserve's `LLM` and `vllm.LLM` on the
same checkpoint, dtype, prompts and batch sizes, one command (issue 50 item 5):

    python benchmarks/vs_vllm_offline.py --dtype float32 --batches 1,32 --rounds 3 --out $OUT/offline-vs-vllm.md

`--image-ttft` also times one request with one 640x360 image to its first token (encode + prefill), each
engine alone: the work a served request adds to the steps of every request decoding beside it.

Each round runs one worker process per engine (the order alternates between rounds), each loading
the model once and timing every batch size: TPOT = (time of N new tokens - time of 1) / (N - 1),
greedy, `ignore_eos`, distinct text prompts (prefill cancels out), the median of `--repeats` inside
the worker. vLLM runs in its own venv (epdserve/bench/peer_vllm.py, built on first use) with the
environment its CPU docs recommend (`vllm_env`: both cores bound, tcmalloc and Intel OpenMP
preloaded); epdserve in this interpreter with the caller's environment less OMP_WAIT_POLICY (both at
their OpenMP defaults). The report gives each
engine's median over rounds with its min-max, and the ratio epdserve / vLLM per round.

The worker (`worker` subcommand) imports nothing of epdserve at module level: both workers run
this file's source (`python -c`), vLLM's in its own venv.
"""
from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import subprocess
import sys
import time
from pathlib import Path

PROMPT = "Tell me a story number {i} about a dragon and a knight"
IMAGE_PROMPT = ("<|im_start|>user\n<|vision_start|><|image_pad|><|vision_end|>Describe this picture.<|im_end|>\n"
                "<|im_start|>assistant\n")
IMAGE_SIZE = (640, 360)  # the largest of the served comparison's JPEGs


def _prompts(batch: int) -> list[str]:
    return [PROMPT.format(i=i) for i in range(batch)]


def _time_engine(generate, batches: list[int], tokens: int, repeats: int) -> dict[str, float]:
    """{batch: TPOT seconds} with `generate(prompts, n_tokens)` running one greedy batch."""
    out = {}
    for b in batches:
        prompts = _prompts(b)
        generate(prompts, 4)  # warm-up at this batch

        def timed(n: int) -> float:
            t = time.perf_counter()
            generate(prompts, n)
            return time.perf_counter() - t

        out[str(b)] = statistics.median((timed(tokens) - timed(1)) / (tokens - 1) for _ in range(repeats))
    return out


def _image_request(k: int) -> dict:
    """One prompt with its own 640x360 image (noise seeded by `k`: no engine finds it in a cache)."""
    import numpy as np
    from PIL import Image

    pixels = np.random.default_rng(k).integers(0, 256, (IMAGE_SIZE[1], IMAGE_SIZE[0], 3), dtype=np.uint8)
    return {"prompt": IMAGE_PROMPT, "multi_modal_data": {"image": Image.fromarray(pixels)}}


def _time_image_ttft(generate, repeats: int) -> float:
    """Seconds to the first token of one image request alone (encode + prefill + one step), the median
    of `repeats` after a warm-up, each with a fresh image."""
    generate([_image_request(0)], 1)
    times = []
    for k in range(1, repeats + 1):
        req = _image_request(k)
        t = time.perf_counter()
        generate([req], 1)
        times.append(time.perf_counter() - t)
    return statistics.median(times)


def _worker(args: argparse.Namespace) -> None:
    batches = [int(b) for b in args.batches.split(",")]
    if args.engine == "vllm":
        from vllm import LLM, SamplingParams

        llm = LLM(model=args.model, dtype=args.dtype, max_model_len=4096, max_num_seqs=max(batches),
                  limit_mm_per_prompt={"video": 0, "image": 2})
        sp = lambda n: SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True)  # noqa: E731
        gen = lambda prompts, n: llm.generate(prompts, sp(n), use_tqdm=False)  # noqa: E731
    else:
        from epdserve import LLM, SamplingParams

        llm = LLM(args.model, device="cpu", dtype=args.dtype, max_num_seqs=max(batches))
        sp = lambda n: SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True)  # noqa: E731
        gen = lambda prompts, n: llm.generate(prompts, sp(n))  # noqa: E731
    result = _time_engine(gen, batches, args.tokens, args.repeats)
    if args.image_ttft:
        result["image_ttft"] = _time_image_ttft(gen, args.repeats)
    print("RESULT " + json.dumps(result), flush=True)


def _run_worker(engine: str, args: argparse.Namespace, python: str, env: dict[str, str]) -> dict[str, float]:
    # this file's source through -c, not its path: a path would put epdserve/bench/ first on sys.path,
    # where profile.py shadows the standard library's (which torch imports)
    cmd = [python, "-c", Path(__file__).read_text(), "worker", "--engine", engine, "--model", args.model, "--dtype",
           args.dtype, "--batches", args.batches, "--tokens", str(args.tokens), "--repeats", str(args.repeats),
           *(["--image-ttft"] if args.image_ttft else [])]
    # a session of its own, killed whole afterwards: vLLM's engine-core and worker processes can
    # outlive the worker's exit, spinning on the cores the next round measures on
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env, cwd="/",
                            start_new_session=True)
    try:
        out, err = proc.communicate(timeout=args.timeout)
    finally:
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        proc.wait()
    lines = [x for x in out.splitlines() if x.startswith("RESULT ")] if proc.returncode is not None else []
    if not lines:
        raise RuntimeError(f"{engine} worker failed (exit {proc.returncode}): {err[-2000:]}")
    return json.loads(lines[-1][len("RESULT "):])


def _environments(venv: Path) -> dict[str, tuple[str, dict[str, str]]]:
    from epdserve.bench.peer_vllm import environ_with, vllm_env

    v_env = environ_with(dict(os.environ), vllm_env(venv))
    repo = str(Path(__file__).resolve().parents[2])
    e_env = dict(os.environ, PYTHONPATH=repo + os.pathsep + os.environ.get("PYTHONPATH", ""))
    # each engine at its own OpenMP default, one process alone on the cores: vLLM's Intel OpenMP spins
    # (vllm_env unsets the policy), and PASSIVE — what `launch` gives instances sharing the cores —
    # cost epdserve's offline step 13% at batch 1 and 23% at 32 here (benchmarks/decode_tpot.py, 2026-12-07)
    e_env.pop("OMP_WAIT_POLICY", None)
    return {"epdserve": (sys.executable, e_env), "vllm": (str(venv / "bin" / "python"), v_env)}


def report(rounds: list[dict[str, dict[str, float]]], args: argparse.Namespace) -> str:
    def fmt(xs: list[float]) -> str:
        m = statistics.median(xs)
        return f"{m:.2f} ({min(xs):.2f}-{max(xs):.2f})" if len(xs) > 1 else f"{m:.2f}"

    lines = [f"model {args.model}, {args.dtype}, {args.tokens} new tokens, {len(rounds)} round(s) alternating the "
             f"engines' order, each figure the median over rounds (min-max) of a worker's median of {args.repeats}",
             "", "| batch | epdserve TPOT ms | vLLM TPOT ms | epdserve tok/s | vLLM tok/s | epdserve / vLLM TPOT "
             "(per round) |", "|---:|---:|---:|---:|---:|---|"]
    for b in args.batches.split(","):
        e = [r["epdserve"][b] * 1e3 for r in rounds]
        v = [r["vllm"][b] * 1e3 for r in rounds]
        ratios = [x / y for x, y in zip(e, v)]
        lines.append(f"| {b} | {fmt(e)} | {fmt(v)} | {fmt([int(b) * 1e3 / x for x in e])} | "
                     f"{fmt([int(b) * 1e3 / x for x in v])} | {statistics.median(ratios):.2f}x "
                     f"({', '.join(f'{r:.2f}' for r in ratios)}) |")
    if args.image_ttft:
        e = [r["epdserve"]["image_ttft"] * 1e3 for r in rounds]
        v = [r["vllm"]["image_ttft"] * 1e3 for r in rounds]
        ratios = [x / y for x, y in zip(e, v)]
        lines += ["", f"One request alone with one {IMAGE_SIZE[0]}x{IMAGE_SIZE[1]} image, time to its first token "
                  "(encode + prefill + a step; a fresh image each time):", "",
                  "| epdserve ms | vLLM ms | epdserve / vLLM (per round) |", "|---:|---:|---|",
                  f"| {fmt(e)} | {fmt(v)} | {statistics.median(ratios):.2f}x ({', '.join(f'{r:.2f}' for r in ratios)}) |"]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("mode", nargs="?", default="compare", choices=("compare", "worker"), help=argparse.SUPPRESS)
    ap.add_argument("--engine", choices=("epdserve", "vllm"), help=argparse.SUPPRESS)
    ap.add_argument("--model", help="checkpoint (default: the small demo Qwen2-VL, built once)")
    ap.add_argument("--dtype", default="bfloat16", help="both engines' dtype")
    ap.add_argument("--batches", default="1,32", help="batch sizes, comma-separated")
    ap.add_argument("--tokens", type=int, default=33, help="new tokens per timed generate")
    ap.add_argument("--repeats", type=int, default=3, help="timed runs per figure inside a worker (median)")
    ap.add_argument("--rounds", type=int, default=3, help="worker pairs, the engines' order alternating")
    ap.add_argument("--image-ttft", action="store_true",
                    help="also time one request with one 640x360 image to its first token (encode + prefill)")
    ap.add_argument("--vllm-venv", help="vLLM's venv (default: peer_vllm's, built on first use)")
    ap.add_argument("--timeout", type=float, default=900.0, help="seconds one worker may take")
    ap.add_argument("--out", help="write the Markdown report here too")
    args = ap.parse_args(argv)
    if args.mode == "worker":
        _worker(args)
        return 0
    from epdserve.bench.peer_vllm import default_vllm_venv, ensure_vllm_venv

    if args.model is None:
        from epdserve.model.demo_cache import cached_demo_model

        args.model = str(cached_demo_model("qwen2_vl", "small"))
    envs = _environments(ensure_vllm_venv(Path(args.vllm_venv) if args.vllm_venv else default_vllm_venv()))
    rounds = []
    for i in range(args.rounds):
        order = ("epdserve", "vllm") if i % 2 == 0 else ("vllm", "epdserve")
        rounds.append({engine: _run_worker(engine, args, *envs[engine]) for engine in order})
        print(f"round {i + 1}: " + json.dumps(rounds[-1]), flush=True)
    text = report(rounds, args)
    print(text)
    if args.out:
        Path(args.out).write_text(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
