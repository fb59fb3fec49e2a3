"""`epdserve bench host` on the tiny demo model with a tiny batch: JSON structure and sanity (no timer asserted)."""
import json

from epdserve.bench.cli import BENCHMARKS
from epdserve.entrypoints.cli import build_parser


def test_host_bench_reports_each_length_and_the_ratio(qwen2_vl_tiny, tmp_path):
    out = tmp_path / "host.json"
    args = build_parser().parse_args(["bench", "host", "--model", str(qwen2_vl_tiny), "--batch-size", "4",
                                      "--output-lens", "16,4", "--window", "4", "--prompt-len", "8",
                                      "--repeats", "2", "--threads", "1", "--out", str(out)])
    assert args.func(args) == 0
    r = json.loads(out.read_text())
    assert r["output_lens"] == [4, 16] and len(r["runs"]) == 2
    for run in r["runs"]:
        assert set(run) == {"4", "16"} and all(s["steps"] == 4 for s in run.values())
    for s in r["per_output_len"].values():
        assert s["host_s"] > 0 and s["forward_s"] > 0 and s["inputs_s"] > 0 and s["update_s"] > 0
    h = r["host_ratio"]
    assert h["longest"] == 16 and h["shortest"] == 4 and len(h["per_repeat"]) == 2
    assert h["min"] <= h["median"] <= h["max"] and isinstance(h["met"], bool)
    assert "host time per decode step" in r["markdown"] and BENCHMARKS["host"].module == "epdserve.bench.host"
