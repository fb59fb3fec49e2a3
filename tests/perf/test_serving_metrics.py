"""Serving metrics against values computed by hand on a small synthetic trace."""
import math

import pytest

from epdserve.perf.serving_metrics import SLO, RequestRecord, compute_metrics, max_rate_meeting_slo, stage_breakdown, ttft_segments


def _trace():
    # r1: image, 4 tokens in 3 messages; TTFT 1.0, E2EL 2.0, TPOT 1.0/3, ITL 0.5, 0.5
    r1 = RequestRecord("r1", t0=0.0, kind="image", num_images=1, chunk_times=[1.0, 1.5, 2.0], chunk_tokens=[1, 1, 2],
                       end=2.0, success=True, prompt_text_tokens=20, vision_tokens=64, prompt_tokens=84, output_tokens=4)
    # r2: text, one token then a usage-only last message; TTFT 3.0, E2EL 3.1, no TPOT, no ITL
    r2 = RequestRecord("r2", t0=0.5, kind="text", chunk_times=[3.5], chunk_tokens=[1], end=3.6, success=True,
                       prompt_text_tokens=50, prompt_tokens=50, output_tokens=1)
    # r3: failed after 0.2 s
    r3 = RequestRecord("r3", t0=1.0, kind="text", end=1.2, success=False, error="UNAVAILABLE")
    # r4: image (features from the store), 4 tokens one by one; TTFT 0.5, E2EL 0.8, TPOT 0.1, ITL 0.1 x3
    r4 = RequestRecord("r4", t0=1.0, kind="image", num_images=2, chunk_times=[1.5, 1.6, 1.7, 1.8],
                       chunk_tokens=[1, 1, 1, 1], end=1.8, success=True, prompt_text_tokens=20, vision_tokens=128,
                       cached_vision_tokens=128, prompt_tokens=148, output_tokens=4)
    return [r1, r2, r3, r4]


def test_per_request_latencies():
    r1, r2, r3, r4 = _trace()
    assert r1.ttft == pytest.approx(1.0) and r1.e2el == pytest.approx(2.0) and r1.tpot == pytest.approx(1 / 3)
    assert r1.itls == pytest.approx([0.5, 0.5])
    assert r2.ttft == pytest.approx(3.0) and r2.e2el == pytest.approx(3.1) and r2.tpot is None and r2.itls == []
    assert r3.ttft is None and r3.e2el is None and r3.tpot is None
    assert r4.tpot == pytest.approx(0.1)


def test_aggregates_hand_computed():
    m = compute_metrics(_trace(), SLO(ttft_ms=2000, tpot_ms=200))
    assert (m["num_requests"], m["completed"], m["failed"]) == (4, 3, 1)
    assert m["errors"] == ["UNAVAILABLE"]
    assert m["duration_s"] == pytest.approx(3.6)  # last end 3.6 - first dispatch 0.0
    assert m["output_tokens"] == 9
    assert m["output_throughput"] == pytest.approx(9 / 3.6)
    assert m["request_throughput"] == pytest.approx(3 / 3.6)
    assert (m["input_text_tokens"], m["input_vision_tokens"], m["cached_vision_tokens"]) == (90, 192, 128)
    assert m["total_token_throughput"] == pytest.approx((90 + 192 + 9) / 3.6)
    # TTFT over [1.0, 3.0, 0.5] s
    t = m["ttft_ms"]
    assert (t["count"], t["mean"], t["median"], t["max"]) == (3, pytest.approx(1500), pytest.approx(1000), pytest.approx(3000))
    assert t["p90"] == pytest.approx(1000 + 0.8 * 2000)  # linear interpolation between 1000 and 3000
    assert m["tpot_ms"]["count"] == 2 and m["tpot_ms"]["mean"] == pytest.approx((1000 / 3 + 100) / 2)
    # ITL pooled: [0.5, 0.5, 0.1, 0.1, 0.1]
    assert m["itl_ms"]["count"] == 5 and m["itl_ms"]["mean"] == pytest.approx(260) and m["itl_ms"]["median"] == pytest.approx(100)
    assert m["e2el_ms"]["max"] == pytest.approx(3100)
    # 1 s buckets from t=0: bucket 1 holds r1's 1.0 and 1.5 (2 tokens) and all of r4 (4 tokens)
    assert m["peak_output_throughput"] == pytest.approx(6)
    # SLO TTFT <= 2 s, TPOT <= 200 ms: r1 misses TPOT, r2 misses TTFT, r3 failed: only r4 is good
    assert m["good_requests"] == 1 and m["goodput"] == pytest.approx(1 / 3.6) and m["slo_attainment"] == pytest.approx(0.25)
    assert m["slo_missed"] == {"ttft": 1, "tpot": 1, "e2el": 0}  # of the completed requests (r3 failed)
    assert m["output_throughput_under_slo"] == pytest.approx(4 / 3.6)  # r4's 4 output tokens
    assert m["slo"] == {"ttft_ms": 2000.0, "tpot_ms": 200.0, "e2el_ms": None}
    # mixed kinds: per-kind metrics; the text kind's TTFT is r2's alone
    assert set(m["by_kind"]) == {"image", "text"}
    assert m["by_kind"]["text"]["ttft_ms"]["median"] == pytest.approx(3000)
    assert m["by_kind"]["text"]["failed"] == 1


def test_single_token_request_counts_tpot_as_zero_for_goodput():
    m = compute_metrics(_trace(), SLO(ttft_ms=3500, tpot_ms=500))
    assert m["good_requests"] == 3  # r2 has N_out = 1: TPOT counts as 0; r3 (failed) is a miss
    assert m["slo_attainment"] == pytest.approx(0.75)
    e2el_only = SLO(ttft_ms=None, tpot_ms=None, e2el_ms=1000)
    assert compute_metrics(_trace(), e2el_only)["good_requests"] == 1  # only r4 (0.8 s)


def test_incomplete_outputs_are_counted():
    r1 = _trace()[0]
    r1.expected_output_tokens = 8
    assert compute_metrics([r1], SLO())["incomplete_outputs"] == 1


def test_empty_and_all_failed():
    m = compute_metrics([RequestRecord("x", t0=0.0, end=0.5, error="boom")], SLO())
    assert m["completed"] == 0 and m["goodput"] == 0 and m["slo_attainment"] == 0
    assert m["ttft_ms"]["count"] == 0 and m["ttft_ms"]["median"] is None


def test_ttft_stage_split_adds_up():
    r = RequestRecord("s", t0=5.0, t0_wall=100.0, chunk_times=[6.0], chunk_tokens=[1], end=6.0, success=True,
                      timing={"arrival": 100.1, "dispatched": 100.15, "encode_start": 100.2, "encode_end": 100.5,
                              "prefill_start": 100.6, "first_token": 100.9, "kv_transfer_end": 101.0,
                              "first_decode": 101.2})
    seg = ttft_segments(r)
    want = {"send": 0.1, "queue": 0.05, "encode wait": 0.05, "encode": 0.3, "E->P / P queue": 0.1, "prefill": 0.3,
            "return": 0.1}
    assert seg == pytest.approx(want)
    assert math.isclose(sum(seg.values()), r.ttft)
    # a text-only request: no encode stamps; its wait is all before prefill
    t = RequestRecord("t", t0=5.0, t0_wall=100.0, chunk_times=[5.6], chunk_tokens=[1], end=5.6, success=True,
                      timing={"arrival": 100.0, "dispatched": 100.0, "encode_start": 0, "encode_end": 0,
                              "prefill_start": 100.3, "first_token": 100.5})
    assert ttft_segments(t) == pytest.approx({"send": 0.0, "queue": 0.0, "E->P / P queue": 0.3, "prefill": 0.2,
                                              "return": 0.1})
    b = stage_breakdown([r, t])
    assert b["requests_with_timings"] == 2
    assert b["encode"]["mean"] == pytest.approx(300) and b["encode"]["count"] == 1
    assert b["encode"]["share_of_mean_ttft"] == pytest.approx(150)
    assert b["P->D"]["mean"] == pytest.approx(100) and b["first decode"]["mean"] == pytest.approx(200)
    shares = sum(v["share_of_mean_ttft"] for v in b.values() if isinstance(v, dict) and "share_of_mean_ttft" in v)
    assert shares == pytest.approx(1e3 * (r.ttft + t.ttft) / 2)


def test_records_without_timestamps_have_no_split():
    assert ttft_segments(_trace()[0]) == {}
    assert stage_breakdown(_trace()) == {"requests_with_timings": 0}


def test_max_rate_meeting_slo():
    def m(ttft_p99, tpot_p99, failed=0):
        return {"failed": failed, "ttft_ms": {"p99": ttft_p99}, "tpot_ms": {"p99": tpot_p99},
                "slo": {"ttft_ms": 2000.0, "tpot_ms": 50.0, "e2el_ms": None}}

    sweep = [(0.5, m(900, 30)), (1.0, m(1900, 45)), (2.0, m(2500, 45)), (4.0, m(1000, 20, failed=1))]
    assert max_rate_meeting_slo(sweep) == 1.0
    assert max_rate_meeting_slo([(1.0, m(2500, 45))]) is None


def _random_trace(n: int = 40, seed: int = 7) -> list[RequestRecord]:
    """`n` requests with seeded random arrivals, TTFTs, token counts and gaps (some with a long stall)."""
    import numpy as np

    rng = np.random.default_rng(seed)
    out = []
    for i in range(n):
        t0 = float(rng.uniform(0, 20))
        times = [t0 + float(rng.uniform(0.2, 5.0))]
        for _ in range(int(rng.integers(1, 33)) - 1):
            gap = float(rng.exponential(0.04)) + (float(rng.uniform(0.2, 0.6)) if rng.random() < 0.05 else 0.0)
            times.append(times[-1] + gap)
        out.append(RequestRecord(f"r{i}", t0=t0, chunk_times=times, chunk_tokens=[1] * len(times), end=times[-1],
                                 success=True, output_tokens=len(times)))
    return out


def test_tpot_itl_percentiles_and_goodput_match_numpy():
    import numpy as np

    recs = _random_trace()
    m = compute_metrics(recs, SLO(ttft_ms=3000, tpot_ms=100))
    ttft = np.array([r.chunk_times[0] - r.t0 for r in recs])
    tpot = np.array([(r.chunk_times[-1] - r.chunk_times[0]) / (len(r.chunk_times) - 1)
                     for r in recs if len(r.chunk_times) > 1])
    gaps = np.concatenate([np.diff(r.chunk_times) for r in recs])
    worst = np.array([np.diff(r.chunk_times).max() for r in recs if len(r.chunk_times) > 1])
    for q in (50, 90, 99):
        assert m["tpot_ms"][f"p{q}"] == pytest.approx(1e3 * np.percentile(tpot, q))
        assert m["itl_ms"][f"p{q}"] == pytest.approx(1e3 * np.percentile(gaps, q))
    assert m["tpot_ms"]["median"] == m["tpot_ms"]["p50"] and m["tpot_ms"]["count"] == tpot.size
    assert m["itl_ms"]["count"] == gaps.size == sum(len(r.chunk_times) - 1 for r in recs)
    assert m["itl_max_ms"]["count"] == worst.size and m["itl_max_ms"]["p99"] == pytest.approx(1e3 * np.percentile(worst, 99))
    # goodput: a request counts when TTFT <= 3 s and its TPOT <= 100 ms (a one-token answer's TPOT counts as 0)
    tpot_all = np.array([(r.chunk_times[-1] - r.chunk_times[0]) / (len(r.chunk_times) - 1) if len(r.chunk_times) > 1
                         else 0.0 for r in recs])
    good = int(((ttft <= 3.0) & (tpot_all <= 0.100)).sum())
    assert 0 < good < len(recs)  # the trace has both kinds, so the SLO is really checked
    dur = max(r.end for r in recs) - min(r.t0 for r in recs)
    assert m["good_requests"] == good and m["goodput"] == pytest.approx(good / dur)
    assert m["slo_attainment"] == pytest.approx(good / len(recs))


def test_itl_max_per_request():
    r1, r2, r3, r4 = _trace()
    assert r1.itl_max == pytest.approx(0.5) and r4.itl_max == pytest.approx(0.1)
    assert r2.itl_max is None and r3.itl_max is None  # one token message; failed
    m = compute_metrics([r1, r2, r3, r4], SLO())
    assert m["itl_max_ms"]["count"] == 2 and m["itl_max_ms"]["max"] == pytest.approx(500)
    assert compute_metrics([], SLO())["tpot_ms"]["p50"] is None
