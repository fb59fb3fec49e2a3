"""`epdserve bench chaos` as CI runs it: the tiny model, EP-D with two instances of each kind
(EP counts for E and P), two clients looping; one EP, one D, the MM Store server and the
scheduler SIGKILLed in turn. The test counts itself, from the bench's per-request journal
(`--requests-out`): every request sent was answered, with no error, and its greedy output equals
transformers' own processor and `generate` (`tests.hf_oracle`), not only the calm pass of the same
deployment; every fault repaired, nothing left behind when the run ends. A negative control shows
the count notices one dropped answer and one changed token."""
from __future__ import annotations

import json
import subprocess
import sys

import pytest

from epdserve.bench.chaos import workload
from tests.hf_oracle import HFOracle

pytestmark = pytest.mark.slow

PROMPTS, MAX_TOKENS = 6, 8


def _problems(records: list[dict], reference: list[list[int]]) -> list[str]:
    """Every request sent must be answered once, without error, with the reference's tokens."""
    sent = {r["id"]: r["prompt"] for r in records if r["event"] == "sent"}
    ends = [r for r in records if r["event"] != "sent"]
    problems = [f"request {r['id']} ended without being sent" for r in ends if r["id"] not in sent]
    problems += [f"request {r['id']} ended twice" for r in ends if sum(e["id"] == r["id"] for e in ends) > 1]
    answered = {r["id"]: r for r in ends}
    for rid, prompt in sent.items():
        end = answered.get(rid)
        if end is None:
            problems.append(f"request {rid} (prompt {prompt}) sent, never answered")
        elif end["event"] == "error":
            problems.append(f"request {rid} (prompt {prompt}) lost: {end['error']}")
        elif end["token_ids"] != reference[prompt]:
            problems.append(f"request {rid} (prompt {prompt}) differs from transformers")
    return problems


@pytest.fixture(scope="module")
def reference(qwen2_vl_tiny):
    hf = HFOracle(qwen2_vl_tiny)
    return [hf.generate(p, im, MAX_TOKENS, ignore_eos=True) for p, im in workload(PROMPTS)]


def test_chaos_loses_nothing_and_leaves_nothing(qwen2_vl_tiny, reference, tmp_path):
    out, journal = tmp_path / "chaos.json", tmp_path / "requests.jsonl"
    proc = subprocess.run(
        [sys.executable, "-m", "epdserve.entrypoints.cli", "bench", "chaos", "--model", str(qwen2_vl_tiny),
         "--mode", "EP-D", "--per-role", "2", "--faults", "EP,D,mm_store,scheduler", "--concurrency", "2",
         "--prompts", str(PROMPTS), "--max-tokens", str(MAX_TOKENS), "--warmup-s", "2", "--fault-interval-s", "1",
         "--back-timeout-s", "90", "--out", str(out), "--requests-out", str(journal)],
        capture_output=True, text=True, timeout=170)
    assert out.exists() and journal.exists(), proc.stdout[-3000:] + proc.stderr[-3000:]
    records = [json.loads(line) for line in journal.read_text().splitlines()]
    sent = [r for r in records if r["event"] == "sent"]
    assert len(sent) >= 2 * PROMPTS  # the load ran through every fault, not one request
    assert _problems(records, reference) == []
    rep = json.loads(out.read_text())
    assert rep["served"] == len(sent) and rep["lost"] == 0 and rep["mismatched"] == 0, rep  # the bench agrees
    assert rep["latency_ms"]["before"]["count"] > 0
    assert [f["target"] for f in rep["faults"]] == ["EP", "D", "mm_store", "scheduler"]
    assert all(f["roster_s"] is not None for f in rep["faults"]), rep["faults"]
    assert rep["left_processes"] == [] and rep["left_ports"] == []
    assert rep["ok"] and proc.returncode == 0
    assert "| during scheduler |" in proc.stdout


def test_the_count_notices_a_dropped_answer_and_a_changed_token(reference):
    """Negative control of `_problems`, on a journal written as the bench writes it."""
    records = []
    for rid in range(4):
        records += [{"id": rid, "client": rid % 2, "prompt": rid, "event": "sent"},
                    {"id": rid, "event": "answered", "token_ids": list(reference[rid])}]
    assert _problems(records, reference) == []
    dropped = [r for r in records if not (r["id"] == 2 and r["event"] == "answered")]
    assert _problems(dropped, reference) == ["request 2 (prompt 2) sent, never answered"]
    changed = [dict(r, token_ids=[r["token_ids"][0] + 1, *r["token_ids"][1:]]) if r["id"] == 1 and "token_ids" in r
               else r for r in records]
    assert _problems(changed, reference) == ["request 1 (prompt 1) differs from transformers"]
    lost = records + [{"id": 4, "client": 0, "prompt": 0, "event": "sent"}, {"id": 4, "event": "error", "error": "X"}]
    assert _problems(lost, reference) == ["request 4 (prompt 0) lost: X"]
