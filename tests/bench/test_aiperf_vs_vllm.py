"""The aiperf comparison's pieces that run without aiperf or vLLM (epdserve/bench/aiperf_vs_vllm.py):
the figures read from aiperf's export (its metric tags and stats), the command it runs (the issue's
workload), and the report's medians and per-round ratios against vLLM."""
from __future__ import annotations

import argparse
import pathlib

from epdserve.bench.aiperf_vs_vllm import aiperf_argv, read_figures, report

EXPORT = {"time_to_first_token": {"unit": "ms", "avg": 300.0, "p50": 250.0},
          "inter_token_latency": {"unit": "ms", "avg": 25.0, "p50": 22.0},
          "request_latency": {"unit": "ms", "avg": 1200.0, "p50": 1100.0},
          "output_token_throughput": {"unit": "tokens/sec", "avg": 90.0},
          "request_count": {"unit": "requests", "avg": 40}}


def _args() -> argparse.Namespace:
    return argparse.Namespace(concurrency=4, requests=40, output_len=32, image_width=320, image_height=240,
                              dtype="float32")


def test_the_figures_come_from_aiperfs_metric_tags():
    assert read_figures(EXPORT) == {"TTFT p50 ms": 250.0, "ITL p50 ms": 22.0, "request latency p50 ms": 1100.0,
                                    "output tok/s": 90.0}
    assert read_figures({"time_to_first_token": {"avg": 1.0}}) == {}  # no p50: nothing made up


def test_the_command_is_the_issues_workload():
    argv = aiperf_argv(pathlib.Path("/v/bin/aiperf"), "http://h:1", "/m", pathlib.Path("/out"), _args())
    pairs = {argv[i]: argv[i + 1] for i in range(2, len(argv) - 1)}
    assert argv[:2] == ["/v/bin/aiperf", "profile"] and "--streaming" in argv
    assert (pairs["--concurrency"], pairs["--request-count"], pairs["--image-batch-size"]) == ("4", "40", "1")
    assert (pairs["--image-width-mean"], pairs["--image-height-mean"]) == ("320", "240")
    assert pairs["--prompt-output-tokens-mean"] == "32" and pairs["--extra-inputs"] == '{"ignore_eos": true}'
    assert pairs["--url"] == "http://h:1" and pairs["--endpoint-type"] == "chat"


def test_the_report_gives_medians_and_per_round_ratios_to_vllm():
    fig = read_figures(EXPORT)
    half = {k: v / 2 for k, v in fig.items()}
    rounds = [{"vllm": fig, "epdserve-monolithic": half}, {"vllm": fig, "epdserve-monolithic": fig}]
    text = report(rounds, _args())
    assert "| vllm | 250.0 (250.0-250.0) | 22.0 (22.0-22.0) | 1100.0 (1100.0-1100.0) | 90.0 (90.0-90.0) |" in text
    assert "| epdserve-monolithic | 187.5 (125.0-250.0) |" in text
    assert "| epdserve-monolithic | 0.75x (0.50, 1.00) |" in text
