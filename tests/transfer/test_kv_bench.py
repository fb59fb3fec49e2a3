"""Smoke test of `epdserve bench kv-transfer`: one tiny round per mode, simulated compute and a
real prefill engine, each checked bit for bit by the decode peer."""
from __future__ import annotations

import argparse
import json

from epdserve.bench import kv_transfer, kv_transfer_cli


def test_bench_runs_all_modes_and_checks_the_kv(qwen2_vl_tiny, tmp_path, capsys):
    parser = argparse.ArgumentParser()
    kv_transfer_cli.add_parser(parser.add_subparsers())
    out = tmp_path / "kv.json"
    args = parser.parse_args(["kv-transfer", "--shapes", "demo-small", "--tokens", "40", "--repeats", "1",
                              "--warmup", "0", "--layer-ms", "0.5", "--engine", str(qwen2_vl_tiny),
                              "--image-px", "56", "--out", str(out)])
    assert args.func(args) == 0
    sim, eng = json.loads(out.read_text())["rows"]
    assert sim["bit_exact"] and sim["kv_bytes"] == 2 * 8 * 48 * 2 * 64 * 4  # 3 blocks of 16 tokens, fp32
    assert sim["raw_ms"] > 0 and sim["after_tail_ms"] > 0 and sim["layerwise_tail_ms"] > 0
    assert eng["shape"].startswith("engine:") and eng["layers"] == 2 and eng["tokens"] >= 40
    assert eng["bit_exact"] and eng["prefill_ms_after"] > 0
    assert "demo-small" in capsys.readouterr().out
