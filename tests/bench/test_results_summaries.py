"""benchmarks/results/ holds summaries, not raw records: under 2 MB, no per-request JSON, every
result file the docs name exists and every plot kept is one the docs show; and
benchmarks/summarize.py turns a run's raw JSON into such a summary (command with `$OUT`, commit,
machine, the benchmark's own tables, no request records)."""
import json
import re
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
RESULTS = REPO / "benchmarks" / "results"
KEPT_JSON = {"profile-small-cpu.json"}  # an input: `epdserve plan --profile`, `launch --mode auto --profile`
DOCS = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md")), RESULTS / "README.md",
        *sorted((REPO / "benchmarks").glob("*.sh")), *sorted((REPO / "benchmarks").glob("*.py"))]


def _files():
    return [p for p in RESULTS.rglob("*") if p.is_file()]


def test_results_stay_small_and_hold_no_raw_records():
    total = sum(p.stat().st_size for p in _files())
    assert total <= 2 * 1024 * 1024, f"benchmarks/results/ is {total / 1e6:.1f} MB: keep summaries, not raw records"
    stray = [p.name for p in _files() if p.suffix == ".json" and p.name not in KEPT_JSON]
    assert not stray, f"raw JSON in benchmarks/results/ (write it to --out outside git, summarize it): {stray}"
    with_records = [p.name for p in _files() if p.suffix in (".json", ".md") and '"requests": [' in p.read_text()]
    assert not with_records, with_records


def test_every_result_the_docs_name_exists():
    named = set()
    for doc in DOCS:
        named |= set(re.findall(r"benchmarks/results/([A-Za-z0-9#._/-]+)", doc.read_text()))
    named = {n.rstrip("/.") for n in named}
    patterns = {n for n in named if n.endswith("-") or n in ("", "NAME.md")}  # `coupling-probe-*.md`, `sweep-{...}`
    missing = [n for n in sorted(named - patterns) if not (RESULTS / n).exists()]
    assert not missing, f"named in the docs but not in benchmarks/results/: {missing}"
    assert "profile-small-cpu.json" in named


def test_every_plot_kept_is_shown():
    shown = set()
    for doc in DOCS:
        shown |= set(re.findall(r"!\[[^\]]*\]\((?:\.\./)*benchmarks/results/([^)]+\.png)\)", doc.read_text()))
    kept = {p.name for p in RESULTS.glob("*.png")}
    assert kept == shown, f"plots kept but not shown: {sorted(kept - shown)}; shown but missing: {sorted(shown - kept)}"


def test_summarize_keeps_the_table_command_commit_and_machine(tmp_path):
    raw = {"benchmark": "serve", "command": "epdserve bench serve --modes monolithic --out /somewhere/run-7.json",
           "cpus": 2, "started": "2026-12-04T10:00:00", "finished": "2026-12-04T10:05:00",
           "launch_env": {"OMP_WAIT_POLICY": "PASSIVE"},
           "workloads": {"mixed": {"modes": {"monolithic": {"runs": [
               {"rate": 1.0, "load_avg_1m": [0.7, 0.5, 0.4], "metrics": {"goodput": 0.9},
                "requests": [{"id": "r0", "ttft_ms": 120.0}, {"id": "r1", "ttft_ms": 130.0}]}]}}}}}
    (tmp_path / "run-7.json").write_text(json.dumps(raw))
    (tmp_path / "run-7.md").write_text("| mode | goodput |\n|---|---:|\n| monolithic | 0.900 |\n")
    out_dir = tmp_path / "results"
    r = subprocess.run([sys.executable, str(REPO / "benchmarks" / "summarize.py"), str(tmp_path / "run-7.json"),
                        "--name", "mixed-monolithic", "--commit", "abc1234", "--machine", "a 2-core test box",
                        "--results-dir", str(out_dir)], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    text = (out_dir / "mixed-monolithic.md").read_text()
    assert "`epdserve bench serve --modes monolithic --out $OUT/mixed-monolithic.json`" in text
    assert "- commit: abc1234" in text and "a 2-core test box; 2 CPUs used; 1-minute load average 0.7–0.7" in text
    assert "`OMP_WAIT_POLICY=PASSIVE`" in text and "| monolithic | 0.900 |" in text
    assert "r0" not in text and "ttft_ms" not in text


def test_summarize_without_tables_keeps_the_json_less_its_records(tmp_path):
    raw = {"mode": "E-P-D", "served": 10, "lost": 0, "requests": [{"id": "x", "ms": 1.0}] * 3}
    (tmp_path / "chaos.json").write_text(json.dumps(raw))
    r = subprocess.run([sys.executable, str(REPO / "benchmarks" / "summarize.py"), str(tmp_path / "chaos.json"),
                        "--command", "epdserve bench chaos --out x.json", "--commit", "abc", "--machine", "m",
                        "--results-dir", str(tmp_path)], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    text = (tmp_path / "chaos.md").read_text()
    assert '"served": 10' in text and '"requests": "<3 records, not kept>"' in text and '"id"' not in text
    assert "`epdserve bench chaos --out $OUT/chaos.json`" in text
