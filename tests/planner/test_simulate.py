"""The simulator on cases small enough to compute by hand (round-number costs from conftest)."""
import pytest

from epdserve.perf.serving_metrics import SLO, compute_metrics
from epdserve.planner.deployment import PlannedDeployment
from epdserve.planner.shapes import RequestShape
from epdserve.planner.simulate import Simulation, simulate


def req(i, t=0.0, items=(), text=20, out=5):
    return RequestShape(f"r{i}", t, tuple(items), text, out, "image" if items else "text")


def test_one_request_alone_disaggregated(round_costs):
    """TTFT = encode + E->P transfer + prefill; then KV transfer and one decode step per token."""
    (r,) = simulate(PlannedDeployment("E-P-D", 1, 1, 1), round_costs, [req(0, items=(100,), text=20, out=5)])
    encode, features, prefill = 50.0, 1.0 + 0.1, 0.2 * 120
    assert r.ttft * 1e3 == pytest.approx(encode + features + prefill)
    kv = 1.0 + 120 * 2000 / 1e9 * 1e3
    assert r.chunk_times[1] - r.chunk_times[0] == pytest.approx((kv + 10.0) / 1e3)
    assert r.tpot * 1e3 == pytest.approx((kv + 4 * 10.0) / 4)
    assert r.n_out == 5


def test_one_request_alone_monolithic_encodes_and_prefills_in_one_step(round_costs):
    (r,) = simulate(PlannedDeployment("monolithic", 1, 1, 1), round_costs, [req(0, items=(100,), text=20, out=3)])
    assert r.ttft * 1e3 == pytest.approx(50.0 + 24.0)
    assert r.tpot * 1e3 == pytest.approx(10.0)


def test_encoder_batches_items_under_the_token_budget(round_costs):
    """Three 400-token images, budget 1024: one call for two, one for the third."""
    (r,) = simulate(PlannedDeployment("E-P-D", 1, 1, 1), round_costs, [req(0, items=(400, 400, 400), text=0, out=1)])
    encode = 0.5 * 800 + 0.5 * 400
    assert r.ttft * 1e3 == pytest.approx(encode + 1.0 + 1200 * 1000 / 1e6 + 0.2 * 1200)


def test_saturated_prefill_server_runs_at_one_request_per_prefill(round_costs):
    shapes = [req(i, text=100, out=1) for i in range(20)]  # 20 ms prefill each, all at t=0
    records = simulate(PlannedDeployment("E-P-D", 1, 1, 1), round_costs, shapes)
    assert sorted(r.end for r in records) == pytest.approx([0.02 * (k + 1) for k in range(20)])
    assert compute_metrics(records, SLO(ttft_ms=None, tpot_ms=None))["request_throughput"] == pytest.approx(50.0)


def test_decode_batch_grows_and_step_time_follows_batch_size(round_costs):
    shapes = [req(i, text=100, out=3) for i in range(2)]
    records = simulate(PlannedDeployment("P-D", 1, 1, 1), round_costs, shapes)
    kv = (1.0 + 100 * 2000 / 1e6) / 1e3
    a, b = sorted(records, key=lambda r: r.end)
    # a: first token at 20 ms, KV at 20+kv, decodes alone (10 ms) until b's KV arrives at 40+kv
    assert a.chunk_times[1] == pytest.approx(0.020 + kv + 0.010)
    assert a.chunk_times[2] == pytest.approx(0.020 + kv + 0.020)
    assert b.chunk_times[1] == pytest.approx(a.chunk_times[2] + 0.010)


def _colocated_pacing(costs, pace_s):
    """On one shared host: A decodes 30 tokens while B1..B3 (60 ms prefills each) queue at 50 ms."""
    shapes = [req(0, text=100, out=30)] + [req(i, t=0.05, text=300, out=1) for i in (1, 2, 3)]
    sim = Simulation(PlannedDeployment("E-P-D", 1, 1, 1, colocated_host=True), costs, tpot_pace_s=pace_s)
    jobs = {j.shape.request_id: j for j in sim.run(shapes)}
    return jobs["r0"].token_times, [jobs[f"r{i}"].token_times[0] for i in (1, 2, 3)]


def test_decode_due_first_when_pace_is_zero(round_costs):
    a, bs = _colocated_pacing(round_costs, 0.0)
    gaps = [y - x for x, y in zip(a[1:], a[2:])]
    assert gaps == pytest.approx([0.010] * len(gaps))  # A never waits
    assert bs == pytest.approx([a[-1] + 0.060 * k for k in (1, 2, 3)])  # B waits for A to finish


def test_queued_prefills_go_first_while_decode_has_slack(round_costs):
    a, bs = _colocated_pacing(round_costs, 10.0)
    start = min(t for t in a if t >= 0.05)  # the decode step running at 50 ms ends here
    assert bs == pytest.approx([start + 0.060 * k for k in (1, 2, 3)])
    assert a[a.index(start) + 1] == pytest.approx(bs[-1] + 0.010)


def test_decode_becomes_due_after_its_slack(round_costs):
    """Pace 100 ms, step 10 ms: slack 90 ms, so A steps in after two 60 ms prefills, not three."""
    a, bs = _colocated_pacing(round_costs, 0.100)
    start = min(t for t in a if t >= 0.05)
    assert bs[:2] == pytest.approx([start + 0.060, start + 0.120])
    assert a[a.index(start) + 1] == pytest.approx(start + 0.130)
    assert bs[2] == pytest.approx(start + 0.190)
