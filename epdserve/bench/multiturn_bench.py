"""The multi-turn comparison (prefix cache on / off, cache-aware / least-load routing) in one
command (`benchmarks/multiturn.py`).

Owns the run: one `epdserve bench serve --workload multiturn` child over six targets launched
one after another, each pair back to back: monolithic with the prefix cache on, then off
(`--cache-off-arg`, default --no-prefix-caching); P-D on, then off; P-D with 2 P instances
(--prefill 2) with the scheduler's default cache-aware routing, then with least-load routing
(`--least-load-arg`, default `--scheduler-args='--routing least-load'`). Every target runs the same
conversations `--repeats` times (repeat k: the same seed, images and start times for every
target, a seed no other repeat uses, so no run finds an earlier run's prefix in the cache); then
the tables of bench/multiturn_compare.py (per target; per pair the turns >= 2 TTFT p50 and SLO
goodput ratios on/off with their min-max over repeats, against the aims) are printed and written
to `<out>.md`, bench serve's own tables (TTFT per turn, cached tokens per turn when reported)
after them. A target that fails to launch is reported; the others still run.
`--quick`: the tiny demo model, 2 conversations of 2 turns, 4-token answers, one repeat.
"""
from __future__ import annotations

import argparse
import json
import pathlib
import shlex
import subprocess
import sys
import time

from epdserve.settings import add_flags, forward_argv
from epdserve.slo import SLO, SLO_FLAGS
from epdserve.bench.multiturn_compare import PAIRS, pair_rows, pair_table, target_table

FULL = {"conversations": 8, "turns": 4, "think_time_s": 2.0, "output_len": 24, "rate": 0.25, "repeats": 3,
        "warmup": 2, "size": "small"}
QUICK = {"conversations": 2, "turns": 2, "think_time_s": 0.2, "output_len": 4, "rate": 1.0, "repeats": 1,
         "warmup": 1, "size": "tiny"}
PAIR_NAMES = {"monolithic": PAIRS[0], "P-D": PAIRS[1], "routing": PAIRS[2]}


def parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="benchmarks/multiturn.py", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", help="checkpoint (default: the small demo Qwen2-VL, built once; --quick: the tiny one)")
    ap.add_argument("--pairs", default="monolithic,P-D,routing",
                    help="which comparisons, in order: monolithic, P-D (cache on/off), routing (2 P: cache-aware / "
                         "least-load) (default all three)")
    ap.add_argument("--quick", action="store_true", help="tiny model, 2 conversations of 2 turns, one repeat")
    ap.add_argument("--repeats", type=int, help="runs per target (default 3; --quick 1)")
    ap.add_argument("--conversations", type=int, help="conversations per run (default 8; --quick 2)")
    ap.add_argument("--turns", type=int, help="turns per conversation (default 4; --quick 2)")
    ap.add_argument("--think-time-s", type=float, help="think time between turns (default 2; --quick 0.2)")
    ap.add_argument("--output-len", type=int, help="answer tokens per turn, mean (default 24; --quick 4)")
    ap.add_argument("--rate", type=float, help="conversations started per second, Poisson (default 0.25; --quick 1)")
    add_flags(ap, SLO, SLO_FLAGS)
    ap.add_argument("--cache-off-arg", default="--no-prefix-caching",
                    help="`epdserve launch` arguments that turn the prefix cache off")
    ap.add_argument("--two-p-arg", default="--prefill 2", help="launch arguments of the 2-P targets")
    ap.add_argument("--least-load-arg", default="--scheduler-args='--routing least-load'",
                    help="launch arguments of the least-load target, added to --two-p-arg, shell-quoted "
                         "(default: --scheduler-args='--routing least-load')")
    ap.add_argument("--launch-arg", default="", help="extra `epdserve launch` arguments for every target")
    ap.add_argument("--bench-arg", action="append", default=[], help="extra `bench serve` argument (repeatable)")
    ap.add_argument("--launch-timeout", type=float, default=900.0, help="seconds a deployment may take to start")
    ap.add_argument("--out", default="multiturn.json", help="bench serve's JSON (the ratios added); also <out>.md")
    return ap


def targets(a, pairs) -> tuple[list[str], list[str]]:
    """The modes (MODE#NAME variants) in run order and their --mode-arg values."""
    variant = {"monolithic#no-cache": a.cache_off_arg, "P-D#no-cache": a.cache_off_arg, "P-D#2P": a.two_p_arg,
               "P-D#2P-least-load": f"{a.two_p_arg} {a.least_load_arg}".strip()}
    modes = [t for p in pairs for t in (p.on, p.off)]
    return modes, [f"{m}={variant[m]}" for m in modes if variant.get(m, "").strip()]


def bench_argv(a, size: dict, model: str, out: pathlib.Path, pairs) -> list[str]:
    modes, mode_args = targets(a, pairs)
    repeats = a.repeats or size["repeats"]
    rate = a.rate or size["rate"]
    argv = ["bench", "serve", "--modes", ",".join(modes), "--model", model, "--workload", "multiturn",
            "--conversations", str(a.conversations or size["conversations"]),
            "--turns", str(a.turns or size["turns"]),
            "--think-time-s", f"{a.think_time_s if a.think_time_s is not None else size['think_time_s']:g}",
            "--output-len", str(a.output_len or size["output_len"]), "--output-len-std", "0",
            "--request-rate", ",".join([f"{rate:g}"] * repeats), "--warmup", str(size["warmup"]),
            *forward_argv(SLO, vars(a), SLO_FLAGS),
            "--slo-note", "the multi-turn comparison's SLOs", "--launch-timeout", f"{a.launch_timeout:g}",
            "--env", "OMP_WAIT_POLICY=PASSIVE", "--no-progress", "--out", str(out)]
    for m in mode_args:
        argv += ["--mode-arg", m]
    if a.launch_arg.strip():
        argv += ["--launch-arg", a.launch_arg]
    return argv + a.bench_arg


def main(argv: list[str] | None = None) -> int:
    a = parser().parse_args(argv)
    size = QUICK if a.quick else FULL
    try:
        pairs = [PAIR_NAMES[p.strip()] for p in a.pairs.split(",") if p.strip()]
    except KeyError as e:
        raise SystemExit(f"--pairs: unknown {e}; known: {', '.join(PAIR_NAMES)}") from None
    if a.model:
        model = a.model
    else:
        from epdserve.bench.offline import default_model

        model = str(default_model("qwen2_vl", size["size"]))
    out = pathlib.Path(a.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    cmd = [sys.executable, "-m", "epdserve.entrypoints.cli", "--log-level", "WARNING",
           *bench_argv(a, size, model, out, pairs)]
    _log("running: " + shlex.join(cmd))
    t0 = time.monotonic()
    proc = subprocess.run(cmd, stdout=subprocess.DEVNULL)  # its per-run log lines (stderr) stay visible
    if not out.is_file():
        _log(f"bench serve wrote no report (exit {proc.returncode})")
        return proc.returncode or 1
    report = json.loads(out.read_text())
    rows = pair_rows(report, tuple(pairs))
    report.update(pairs=rows, wall_s=round(time.monotonic() - t0, 1),
                  benchmark_command="python benchmarks/multiturn.py " + shlex.join(argv if argv is not None
                                                                                   else sys.argv[1:]))
    out.write_text(json.dumps(report, indent=1, default=str) + "\n")
    text = render(report, rows, [t for p in pairs for t in (p.on, p.off)])
    out.with_suffix(".md").write_text(text + "\n")
    print(text)
    print(f"\nwrote {out}, {out.with_suffix('.md')} in {report['wall_s']:.0f} s")
    failed = [t for t, v in report.get("targets", {}).items() if v.get("error")]
    return 1 if proc.returncode or failed else 0


def render(report: dict, rows: list[dict], order: list[str]) -> str:
    from epdserve.bench.report import markdown

    w = next(iter(report.get("workloads", {}).values()), {})
    lines = [f"## Multi-turn: {w.get('summary', '')}", "",
             f"model {report.get('model')}; targets one after another, each pair back to back; every figure the median "
             "over repeats, (min-max) when there are several; repeat k of every target had the same conversations "
             "at the same times.", "", target_table(report, order), "",
             "On / off (ratio of the medians; per-repeat ratios' min-max):", "", pair_table(rows)]
    for label, t in (report.get("targets") or {}).items():
        if t.get("error"):
            lines.append(f"\n{label} failed to launch: {t['error'].splitlines()[0]}")
    lines += ["", "<details><summary>bench serve's tables</summary>", "", markdown(report, baseline=order[0]), "",
              "</details>"]
    return "\n".join(lines)


def _log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)
