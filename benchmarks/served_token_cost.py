"""Where a served token's cost goes (issue 50 item 1): CPU ms per output token by process and stage,
at a light load and in a burst, one launched deployment, its OpenAI HTTP front driven by `bench serve`.

    python benchmarks/served_token_cost.py [--model DIR] [--mode monolithic] [--dtype auto]
                                           [--launch-arg ARGS] [--repeats 2] [--out results/token-cost.md]

Each phase: the processes' CPU seconds (epdserve/bench/token_cost.py `cpu_seconds`) before and after
`bench serve` runs its requests, and py-spy sampling the scheduler (with its HTTP front) and every
instance for the whole phase (`classify_stacks`: samples by stage), so each process's CPU seconds
split over its stages. Divided by the phase's output tokens: CPU ms per served token. The bench's
own TTFT and TPOT p50 come with it. Phases: `light` (24 requests at 1 req/s, 32 tokens, half with a
320x180 image) and `burst` (32 requests at once, 64 tokens, text). Every figure is the median of
`--repeats` rounds, (min-max) beside it. Only comparisons inside one run mean anything.
"""
from __future__ import annotations

import argparse
import json
import pathlib
import shlex
import statistics
import subprocess
import sys
import time

from epdserve.bench.token_cost import STAGE_NAMES, classify_stacks, cpu_seconds, process_roles

PHASES = {
    "light": ["--num-requests", "24", "--request-rate", "1", "--output-len", "32", "--text-only-share", "0.5",
              "--images-per-request", "1", "--resolution-mix", "320x180:1"],
    "burst": ["--num-requests", "32", "--request-rate", "inf", "--output-len", "64", "--text-only-share", "1"],
}
COMMON = ["--workload", "sharegpt4o", "--output-len-std", "0", "--seed", "0", "--no-progress", "--warmup", "2"]


def _spy(pid: int, out: pathlib.Path) -> subprocess.Popen:
    return subprocess.Popen(["py-spy", "record", "--pid", str(pid), "--format", "raw", "--rate", "100",
                             "--nonblocking", "--output", str(out)],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)


def run_phase(url: str, roles: dict[str, int], phase: str, tmp: pathlib.Path, k: int) -> dict:
    report = tmp / f"{phase}-{k}.json"
    spies = {name: (_spy(pid, tmp / f"{phase}-{k}-{name.replace(':', '_')}.txt"),
                    tmp / f"{phase}-{k}-{name.replace(':', '_')}.txt")
             for name, pid in roles.items() if name == "scheduler" or name.startswith("instance")}
    time.sleep(1.0)  # py-spy attached before the first request
    before, t0 = cpu_seconds(roles), time.monotonic()
    subprocess.run([sys.executable, "-m", "epdserve.entrypoints.cli", "--log-level", "WARNING", "bench", "serve",
                    "--backend", "openai", "--base-url", url, "--label", phase, "--out", str(report),
                    *COMMON, *PHASES[phase]], check=True, stdout=subprocess.DEVNULL)
    after, wall = cpu_seconds(roles), time.monotonic() - t0
    for proc, _ in spies.values():
        proc.send_signal(2)  # SIGINT: py-spy writes its profile and exits
    for proc, _ in spies.values():
        proc.wait(60)
    bench = json.loads(report.read_text())
    run = next(iter(next(iter(bench["workloads"].values()))["modes"].values()))["runs"][0]
    tokens = int(run["metrics"]["output_tokens"])  # the measured requests' (the warm-up's are not counted)
    cpu = {name: after[name] - before[name] for name in roles}
    stages: dict[str, dict[str, float]] = {}
    for name, (_, path) in spies.items():
        counts = classify_stacks(path.read_text()) if path.exists() else {}
        total = sum(counts.values()) or 1
        stages[name] = {s: cpu[name] * counts.get(s, 0) / total * 1e3 / tokens for s in STAGE_NAMES}
    m = run["metrics"]
    return {"tokens": tokens, "wall_s": wall, "cpu_ms_per_token": {n: c * 1e3 / tokens for n, c in cpu.items()},
            "stage_ms_per_token": stages, "ttft_p50_ms": m["ttft_ms"]["median"], "tpot_p50_ms": m["tpot_ms"]["median"],
            "output_tok_s": m.get("output_throughput")}


def _cell(values: list[float], nd: int = 2) -> str:
    values = [v for v in values if v is not None]
    if not values:
        return "-"
    med = statistics.median(values)
    return f"{med:.{nd}f}" + (f" ({min(values):.{nd}f}-{max(values):.{nd}f})" if len(values) > 1 else "")


def render(results: dict[str, list[dict]], header: str) -> str:
    lines = [header, ""]
    for phase, runs in results.items():
        lines += [f"### {phase}: TTFT p50 {_cell([r['ttft_p50_ms'] for r in runs], 0)} ms, TPOT p50 "
                  f"{_cell([r['tpot_p50_ms'] for r in runs], 1)} ms, {_cell([r['output_tok_s'] for r in runs], 0)} "
                  f"output tok/s", "", "| process | CPU ms / token |", "|---|---:|"]
        for name in runs[0]["cpu_ms_per_token"]:
            lines.append(f"| {name} | {_cell([r['cpu_ms_per_token'][name] for r in runs])} |")
        lines += ["", "| process | " + " | ".join(STAGE_NAMES) + " |", "|---|" + "---:|" * len(STAGE_NAMES)]
        for name in runs[0]["stage_ms_per_token"]:
            lines.append(f"| {name} | " + " | ".join(_cell([r["stage_ms_per_token"][name][s] for r in runs])
                                                   for s in STAGE_NAMES) + " |")
        lines.append("")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    from epdserve.deploy.local.launched import launched

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", help="checkpoint (default: the small demo Qwen2-VL, built once)")
    ap.add_argument("--mode", default="monolithic")
    ap.add_argument("--dtype", default="auto", help="--dtype of the instances (default auto)")
    ap.add_argument("--launch-arg", default="", help="extra `epdserve launch` arguments")
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--phases", default="light,burst")
    ap.add_argument("--out", default="token-cost.md")
    a = ap.parse_args(argv)
    if a.model is None:
        from epdserve.bench.offline import default_model

        a.model = str(default_model("qwen2_vl", "small"))
    phases = [p for p in a.phases.split(",") if p]
    results: dict[str, list[dict]] = {p: [] for p in phases}
    extra = ["--http-port", "0", "--instance-args", f"--dtype {a.dtype}", *shlex.split(a.launch_arg)]
    profiles = pathlib.Path(a.out).with_suffix(".profiles")  # py-spy's raw stacks, kept beside the report
    profiles.mkdir(parents=True, exist_ok=True)
    with launched(a.mode, a.model, extra, ready_timeout_s=900, env={"OMP_WAIT_POLICY": "PASSIVE"}) as dep:
        url = dep.ready_line.split("http=")[1].split()[0].replace("//0.0.0.0:", "//127.0.0.1:")
        roles = process_roles(dep.pid)
        for k in range(a.repeats):
            for phase in phases:  # alternated: light, burst, light, burst, ...
                results[phase].append(run_phase(url, roles, phase, profiles, k))
                print(f"[{phase} {k}] {json.dumps(results[phase][-1]['cpu_ms_per_token'])}", file=sys.stderr)
        ready = dep.ready_line
    cmd = "python benchmarks/served_token_cost.py " + " ".join(map(shlex.quote, argv or sys.argv[1:]))
    header = (f"## Served token cost by process and stage: {a.mode}, {pathlib.Path(a.model).name}\n\n"
              f"`{cmd}`; ready line: `{ready}`; {a.repeats} round(s) per phase, phases alternated; median "
              f"(min-max). CPU ms per output token: a process's user+system CPU over the phase / the phase's "
              f"output tokens; stages split it by py-spy samples (epdserve/bench/token_cost.py).")
    text = render(results, header)
    out = pathlib.Path(a.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(text + "\n")
    out.with_suffix(".json").write_text(json.dumps(results, indent=1) + "\n")
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
