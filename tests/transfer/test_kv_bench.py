"""Smoke test of `epdserve bench kv-transfer`: one tiny round per mode, checked bit for bit."""
from __future__ import annotations

import argparse
import json

from epdserve.bench import kv_transfer


def test_bench_runs_all_modes_and_checks_the_kv(tmp_path, capsys):
    parser = argparse.ArgumentParser()
    kv_transfer.add_parser(parser.add_subparsers())
    out = tmp_path / "kv.json"
    args = parser.parse_args(["kv-transfer", "--shapes", "demo-small", "--tokens", "40", "--repeats", "1",
                              "--warmup", "0", "--layer-ms", "0.5", "--out", str(out)])
    assert args.func(args) == 0
    (row,) = json.loads(out.read_text())["rows"]
    assert row["bit_exact"] and row["kv_bytes"] == 2 * 8 * 48 * 2 * 64 * 4
    assert row["raw_ms"] > 0 and row["after_tail_ms"] > 0 and row["layerwise_tail_ms"] > 0
    assert "demo-small" in capsys.readouterr().out
