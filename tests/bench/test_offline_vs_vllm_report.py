"""The offline comparison's report (epdserve/bench/offline_vs_vllm.py): per batch the medians over
rounds and the per-round ratios; with --image-ttft, the image request's time to first token and its
ratio per round. The workers themselves need vLLM's venv (not built by the suite)."""
from __future__ import annotations

import argparse

from epdserve.bench.offline_vs_vllm import _image_request, report


def _args(image_ttft: bool) -> argparse.Namespace:
    return argparse.Namespace(model="m", dtype="float32", tokens=33, repeats=3, batches="1,32", image_ttft=image_ttft)


ROUNDS = [{"epdserve": {"1": 0.012, "32": 0.040, "image_ttft": 0.30}, "vllm": {"1": 0.010, "32": 0.050, "image_ttft": 0.20}},
          {"epdserve": {"1": 0.011, "32": 0.044, "image_ttft": 0.36}, "vllm": {"1": 0.011, "32": 0.040, "image_ttft": 0.24}}]


def test_the_report_gives_each_batch_and_the_image_ttft_with_per_round_ratios():
    text = report(ROUNDS, _args(True))
    assert "| 1 | 11.50 (11.00-12.00) | 10.50 (10.00-11.00) |" in text and "1.10x (1.20, 1.00)" in text
    assert "| 32 |" in text and "0.95x (0.80, 1.10)" in text
    assert "| 330.00 (300.00-360.00) | 220.00 (200.00-240.00) | 1.50x (1.50, 1.50) |" in text
    assert "image" not in report(ROUNDS, _args(False))


def test_each_image_request_carries_its_own_image():
    a, b = _image_request(1), _image_request(2)
    assert a["prompt"].count("<|image_pad|>") == 1
    assert a["multi_modal_data"]["image"].size == (640, 360)
    assert a["multi_modal_data"]["image"].tobytes() != b["multi_modal_data"]["image"].tobytes()
