"""`epdserve bench soak` for a few seconds: a real E-P-D deployment (one instance per role, tiny
model), the whole catalogue, one E instance SIGKILLed and restarted by the launcher; the report's
structure and counters."""
from __future__ import annotations

import argparse
import json

from epdserve.bench import soak
from epdserve.bench.soak_traffic import KINDS

ROLES = ("E", "P", "D")


def _args(model, out) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    soak.add_parser(parser.add_subparsers())
    return parser.parse_args(["soak", "--model", str(model), "--out", str(out), "--minutes", "0.25",
                              "--kill-every-min", "0.15", "--kill-roles", "E", "--per-role", "1",
                              "--concurrency", "2", "--max-tokens", "4", "--sampled-max-tokens", "16",
                              "--back-timeout-s", "600"])


def test_short_soak_kills_one_instance_and_counts_every_request(qwen2_vl_tiny, tmp_path):
    out = tmp_path / "soak.json"
    rc = soak.run(_args(qwen2_vl_tiny, out))
    rep = json.loads(out.read_text())
    r = rep["requests"]

    # counters: every request the load started is either answered or lost, per kind and in all
    assert r["sent"] > 0 and r["sent"] == r["answered"] + r["lost"]
    for kind in KINDS:
        k = r["by_kind"][kind]
        assert k["sent"] > 0 and k["sent"] == k["answered"] + k["lost"] and k["compared"] <= k["answered"]
    assert sum(k["sent"] for k in r["by_kind"].values()) == r["sent"]
    assert set(rep["warmup"]) >= {"sent", "answered", "lost", "compared", "differing"}
    assert rep["warmup"]["sent"] == len(rep["config"]["catalogue"])
    # nothing lost, every greedy answer the offline engine's token for token (also in the warm-up)
    assert r["lost"] == 0, r["lost_examples"]
    assert r["compared"] > 0 and r["differing"] == 0, r["differing_examples"]
    assert rep["warmup"]["compared"] > 0 and rep["warmup"]["differing"] == 0
    assert r["sampled_json"]["invalid_json"] == 0

    # exactly one kill, of an E instance, repaired: the roster whole again with a new process
    assert [k["role"] for k in rep["kills"]] == ["E"]
    kill = rep["kills"][0]
    assert kill["roster_s"] is not None and kill["process_s"] is not None
    # RSS read for every process of the deployment at both ends; the killed one's slot restarted
    rows = {row["slot"]: row for row in rep["rss"]}
    assert {"launcher", "scheduler", "mm_store", "E#0", "P#0", "D#0"} <= set(rows)
    assert all(row["start_mb"] and row["end_mb"] for row in rep["rss"]), rep["rss"]
    assert [s for s, row in rows.items() if row["restarted"]] == ["E#0"]
    assert rows["E#0"]["pid_start"] == kill["pid"] != rows["E#0"]["pid_end"]
    assert rc == 0 and rep["ok"] is True

    md = out.with_suffix(".md").read_text()
    assert f"sent {r['sent']}, answered {r['answered']}, lost 0" in md
    assert "| E#0 |" in md and "| scheduler |" in md
