"""bench serve --workload multiturn end to end on the tiny model: a real `epdserve launch`, real gRPC,
each turn's history built from the answers the deployment streamed back."""
import json

import pytest

from epdserve.entrypoints.cli import main


@pytest.mark.slow  # one deployment starts (30-60 s on 2 cores)
def test_multiturn_against_a_launched_monolithic(qwen2_vl_tiny, tmp_path, capsys):
    out = tmp_path / "mt.json"
    rc = main(["bench", "serve", "--modes", "monolithic", "--model", str(qwen2_vl_tiny), "--workload", "multiturn",
               "--conversations", "2", "--turns", "3", "--think-time-s", "0.1", "--resolution-scale", "0.1",
               "--output-len", "4", "--output-len-range", "4-4", "--request-rate", "2", "--warmup", "1",
               "--no-progress", "--out", str(out)])
    assert rc == 0
    run = json.loads(out.read_text())["workloads"]["multiturn"]["modes"]["monolithic"]["runs"][0]
    m = run["metrics"]
    assert (m["completed"], m["failed"], m["incomplete_outputs"]) == (6, 0, 0)
    assert [p["turn"] for p in run["turns"]["per_turn"]] == [1, 2, 3]
    assert all(p["completed"] == 2 for p in run["turns"]["per_turn"])
    rows = sorted(run["requests"], key=lambda r: (r["id"].rsplit("-t", 1)[0], r["turn"]))
    for a, b in zip(rows, rows[1:]):
        if b["turn"] > 1:  # the history grew by the answer and a question; the images came again
            assert b["prompt_tokens"] > a["prompt_tokens"] + a["output_tokens"] and b["images"] == a["images"]
    if "cached_tokens" in rows[0]:  # the server reports KV-cached prompt tokens: later turns reuse the history
        assert all(r["cached_tokens"] > 0 for r in rows if r["turn"] > 1)
    assert "TTFT p50 per turn" in capsys.readouterr().out
