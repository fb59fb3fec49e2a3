"""Shared pieces of the planner tests: the real profile (benchmarks/results/), a recorded `bench serve`
run with its per-request records (data/serve-image-heavy-trace.json: image-heavy, 40 requests at
1 req/s, five modes, the small demo model on the 2-core dev machine), and round-number costs."""
from pathlib import Path

import pytest

from epdserve.planner.costs import CostModel, Curve

RESULTS = Path(__file__).resolve().parents[2] / "benchmarks" / "results"
PROFILE = RESULTS / "profile-small-cpu.json"
SERVE = Path(__file__).resolve().parent / "data" / "serve-image-heavy-trace.json"


@pytest.fixture
def round_costs() -> CostModel:
    """encode 0.5 ms/token, prefill 0.2 ms/token, decode 8 + 2*batch ms, no preprocessing,
    1000 feature bytes per vision token, 2000 KV bytes per token, 1 GB/s + 1 ms per transfer."""
    return CostModel(encode=Curve((100.0, 200.0), (50.0, 100.0)), preprocess=Curve((1.0, 2.0), (0.0, 0.0)),
                     prefill=Curve((100.0, 200.0), (20.0, 40.0)), decode=Curve((1.0, 2.0), (10.0, 12.0)),
                     feature_bytes_per_token=1000.0, kv_bytes_per_token=2000.0, link_gbps=1.0, link_latency_ms=1.0)
