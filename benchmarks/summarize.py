"""One benchmark run's raw JSON → the summary kept in git (`benchmarks/results/NAME.md`).

A benchmark writes its raw records (every request's latencies and stage times) where `--out`
points; they stay out of git. What the repository keeps of a run is one Markdown file per figure:
what was run (the command, its `--out` shown as `$OUT/NAME.json`), the commit, the machine, when,
and the tables — the benchmark's own Markdown (`RAW.md`, written beside the JSON by `bench serve`,
`vs_transformers_serve.py`, `multiturn.py`; or the report's `markdown` field),
else the JSON itself with every per-request list left out.

    python benchmarks/summarize.py $OUT/sweep-mixed-split.json                      # → benchmarks/results/sweep-mixed-split.md
    python benchmarks/summarize.py RAW.json --name NAME --command "..." --machine "..." --commit SHA

--commit defaults to this checkout's HEAD (with "+changes" when the tree differs from it), and
--machine to this machine's CPU model and core count: run it where the benchmark ran, right after.
Plots (`RAW-*.png`) are copied only with --plots (keep in git only those the docs show).
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import re
import shutil
import subprocess
import sys
from pathlib import Path

RESULTS = Path(__file__).resolve().parent / "results"
PER_REQUEST_KEYS = ("requests", "records", "turns", "timeline")  # lists with one entry per request (or per event)


def without_records(value):
    """`value` with every per-request list replaced by its length."""
    if isinstance(value, dict):
        return {k: (f"<{len(v)} records, not kept>" if k in PER_REQUEST_KEYS and isinstance(v, list)
                    else without_records(v)) for k, v in value.items()}
    if isinstance(value, list):
        return [without_records(v) for v in value]
    return value


def recorded_command(raw: dict) -> str | None:
    """The command the run recorded (the one-command wrappers' own first, then bench serve's)."""
    for key in ("benchmark_command", "command"):
        if isinstance(raw.get(key), str) and " " in raw[key]:
            return raw[key]
    args = raw.get("args")
    if isinstance(args, dict) and isinstance(args.get("command"), str) and " " in args["command"]:
        return args["command"]
    return None


def out_as_placeholder(command: str, name: str) -> str:
    """The command with its --out / --json path written as $OUT/NAME.json (raw records live outside git)."""
    return re.sub(r"(--out|--json)(=|\s+)('[^']*'|\"[^\"]*\"|\S+)", rf"\1\2$OUT/{name}.json", command)


def tables(raw_path: Path, raw: dict) -> str:
    md = raw_path.with_suffix(".md")
    if md.exists():
        return md.read_text().strip()
    if isinstance(raw.get("markdown"), str):
        return raw["markdown"].strip()
    return "```json\n" + json.dumps(without_records(raw), indent=1) + "\n```"


def head_commit() -> str:
    repo = Path(__file__).resolve().parents[1]
    try:
        sha = subprocess.run(["git", "rev-parse", "--short=12", "HEAD"], cwd=repo, capture_output=True, text=True,
                             check=True).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=repo,
                               capture_output=True, text=True, check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown (not a git checkout)"
    return sha + (" +changes" if dirty else "")


def this_machine() -> str:
    model = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                model = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return f"{model}, {os.cpu_count()} logical CPUs, {platform.system()} {platform.release()}"


def load_range(raw) -> str | None:
    """min–max of the 1-minute load averages the run recorded (bench serve: per cell)."""
    found = []

    def walk(v):
        if isinstance(v, dict):
            for k, x in v.items():
                if k == "load_avg_1m" and isinstance(x, list) and x:
                    found.append(float(x[0]))
                elif k != "requests":
                    walk(x)
        elif isinstance(v, list):
            for x in v:
                walk(x)
    walk(raw)
    return f"{min(found):.1f}–{max(found):.1f}" if found else None


def summary(raw_path: Path, name: str, command: str | None, commit: str, machine: str, note: str | None) -> str:
    raw = json.loads(raw_path.read_text())
    command = command or recorded_command(raw)
    lines = [f"# {name}", ""]
    if note:
        lines += [note, ""]
    lines.append("- command: " + (f"`{out_as_placeholder(command, name)}`" if command else "not recorded"))
    if raw.get("peer_cmd"):
        lines.append(f"- peer: `{raw['peer_cmd']}`")
    lines.append(f"- commit: {commit}")
    machine_bits = [machine]
    if raw.get("cpus"):
        machine_bits.append(f"{raw['cpus']} CPUs used")
    load = load_range(raw)
    if load:
        machine_bits.append(f"1-minute load average {load} at the cells' starts")
    lines.append("- machine: " + "; ".join(machine_bits))
    when = " → ".join(str(raw[k]) for k in ("started", "finished") if raw.get(k))
    if when:
        lines.append(f"- run: {when}")
    if raw.get("model"):
        lines.append(f"- model: `{raw['model']}`")
    if raw.get("launch_env"):
        lines.append("- environment of every process: " + ", ".join(f"`{k}={v}`" for k, v in raw["launch_env"].items()))
    lines += ["- raw records: not kept in git; the command writes them to `$OUT`", "", tables(raw_path, raw), ""]
    return "\n".join(lines)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="benchmarks/summarize.py", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("raw", type=Path, help="the run's raw JSON (its .md, if any, beside it)")
    p.add_argument("--name", help="the summary's name, saying what was measured (default: the raw file's stem)")
    p.add_argument("--command", help="the command, when the raw JSON does not record it")
    p.add_argument("--commit", help="the commit measured (default: this checkout's HEAD)")
    p.add_argument("--machine", help="the machine it ran on (default: this machine's CPU model and cores)")
    p.add_argument("--note", help="one line under the title: what the figure is")
    p.add_argument("--plots", action="store_true", help="also copy the run's plots (RAW-*.png) beside the summary")
    p.add_argument("--results-dir", type=Path, default=RESULTS, help="where summaries go (default benchmarks/results)")
    a = p.parse_args(argv)
    if not a.raw.is_file():
        p.error(f"{a.raw}: no such file")
    name = a.name or a.raw.stem
    text = summary(a.raw, name, a.command, a.commit or head_commit(), a.machine or this_machine(), a.note)
    a.results_dir.mkdir(parents=True, exist_ok=True)
    out = a.results_dir / f"{name}.md"
    out.write_text(text)
    print(out)
    if a.plots:
        for png in sorted(a.raw.parent.glob(a.raw.stem + "-*.png")):
            dest = a.results_dir / (name + png.name[len(a.raw.stem):])
            shutil.copyfile(png, dest)
            print(dest)
    return 0


if __name__ == "__main__":
    sys.exit(main())
