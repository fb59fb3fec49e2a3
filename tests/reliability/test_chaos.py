"""`epdserve bench chaos` as CI runs it: the tiny model, EP-D with two instances of each kind
(EP counts for E and P), two clients looping; one EP, one D, the MM Store server and the
scheduler SIGKILLed in turn. No request lost, no greedy output differing from the calm pass,
every fault repaired, nothing left behind when the run ends."""
from __future__ import annotations

import json
import subprocess
import sys

import pytest

pytestmark = pytest.mark.slow


def test_chaos_loses_nothing_and_leaves_nothing(qwen2_vl_tiny, tmp_path):
    out = tmp_path / "chaos.json"
    proc = subprocess.run(
        [sys.executable, "-m", "epdserve.entrypoints.cli", "bench", "chaos", "--model", str(qwen2_vl_tiny),
         "--mode", "EP-D", "--per-role", "2", "--faults", "EP,D,mm_store,scheduler", "--concurrency", "2",
         "--prompts", "6", "--max-tokens", "8", "--warmup-s", "2", "--fault-interval-s", "1",
         "--back-timeout-s", "90", "--out", str(out)],
        capture_output=True, text=True, timeout=170)
    assert out.exists(), proc.stdout[-3000:] + proc.stderr[-3000:]
    rep = json.loads(out.read_text())
    assert rep["served"] > 0 and rep["latency_ms"]["before"]["count"] > 0
    assert rep["lost"] == 0 and rep["mismatched"] == 0, rep
    assert [f["target"] for f in rep["faults"]] == ["EP", "D", "mm_store", "scheduler"]
    assert all(f["roster_s"] is not None for f in rep["faults"]), rep["faults"]
    assert rep["left_processes"] == [] and rep["left_ports"] == []
    assert rep["ok"] and proc.returncode == 0
    assert "| during scheduler |" in proc.stdout
