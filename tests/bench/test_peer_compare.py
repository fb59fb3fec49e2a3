"""The peer comparison's tables from synthetic reports: medians and spreads over repeats, ratios
paired run by run, the aims checked, an earlier run as the reference."""
import math

import pytest

from epdserve.bench.peer_compare import (AIMS, VLLM_AIMS, Aim, cells, comparison_table, merge_reports, ratio_rows,
                                        ratio_table)


def _m(ttft, tpot50, tpot99, itl99, goodput, good=20, n=24):
    return {"ttft_ms": {"median": ttft}, "tpot_ms": {"median": tpot50, "p90": tpot50 * 1.5, "p99": tpot99},
            "itl_ms": {"median": itl99 / 10, "p99": itl99}, "goodput": goodput, "good_requests": good, "num_requests": n}


def _part(label, runs):
    """One target's bench-serve report; runs: [(rate, metrics)] in the order they ran."""
    return {"slo": {"ttft_ms": 3000, "tpot_ms": 100}, "targets": {label: {}},
            "workloads": {"sharegpt4o": {"summary": "s", "modes": {label: {"runs": [
                {"rate": r, "metrics": m} for r, m in runs]}}}}}


PEER = _part("transformers-serve", [(0.5, _m(3000, 37, 40, 50, 0.4)), (1.0, _m(17000, 37, 41, 52, 0.10, good=5)),
                                    (0.5, _m(3400, 38, 44, 55, 0.4)), (1.0, _m(18000, 36, 40, 50, 0.05, good=3))])
MONO = _part("epdserve-monolithic", [(0.5, _m(660, 40, 70, 300, 0.45)), (1.0, _m(1400, 60, 200, 900, 0.30, good=15)),
                                     (0.5, _m(700, 42, 90, 320, 0.45)), (1.0, _m(7600, 90, 400, 1500, 0.20, good=10))])


def test_merge_and_cells_keep_repeat_order():
    rep = merge_reports([PEER, MONO])
    assert list(rep["targets"]) == ["transformers-serve", "epdserve-monolithic"]
    c = cells(rep)
    assert sorted(c["epdserve-monolithic"]) == [0.5, 1.0]
    assert [m["ttft_ms"]["median"] for m in c["epdserve-monolithic"][1.0]] == [1400, 7600]


def test_comparison_table_medians_and_spread():
    md = comparison_table(merge_reports([PEER, MONO]), "transformers-serve")
    rows = [r for r in md.splitlines() if r.startswith("| 0.5/s") or r.startswith("| 1/s")]
    assert rows[0].startswith("| 0.5/s | transformers-serve | 2 | 3,200 (3,000-3,400) | 37.5 (37.0-38.0) |")
    assert "| 1/s | epdserve-monolithic | 2 | 4,500 (1,400-7,600) | 75.0 (60.0-90.0) |" in md
    assert "| ITL p50 ms | ITL p99 ms |" in md  # the median gap beside the worst: a step policy moves both
    assert "| 120.0 (90.0-150.0) | 1,200.0 (900.0-1,500.0) |" in md  # monolithic at 1/s: ITL p50, p99
    # goodput, output tok/s (none in these metrics), in SLO, missed, ended early
    assert "0.250 (0.200-0.300) | - | 12.5/24 (10-15) | 0 / 0 | 0 |" in md


def test_which_objective_the_others_missed():
    """From the metrics' counts, or, in a report from before them, from its request records."""
    counted = _part("epdserve-P-D", [(1.0, {**_m(900, 50, 90, 200, 0.4), "slo_missed": {"ttft": 3, "tpot": 1}}),
                                     (1.0, {**_m(900, 50, 90, 200, 0.4), "slo_missed": {"ttft": 5, "tpot": 0}})])
    assert "| 20/24 | 4 (3-5) / 0 (0-1) | 0 |" in comparison_table(merge_reports([counted]), "transformers-serve")
    old = _part("epdserve-E-PD", [(1.0, _m(900, 50, 90, 200, 0.4))])
    old["workloads"]["sharegpt4o"]["modes"]["epdserve-E-PD"]["runs"][0]["requests"] = [
        {"ok": True, "ttft_ms": 3500, "tpot_ms": 40}, {"ok": True, "ttft_ms": 100, "tpot_ms": 120},
        {"ok": True, "ttft_ms": 3100, "tpot_ms": 101}, {"ok": False, "ttft_ms": None, "tpot_ms": None}]
    assert cells(merge_reports([old]))["epdserve-E-PD"][1.0][0]["slo_missed"] == {"ttft": 2, "tpot": 2, "e2el": 0}


def test_ratios_paired_by_repeat_and_aims():
    rows = ratio_rows(merge_reports([PEER, MONO]), "transformers-serve")
    by = {(r["rate"], r["figure"], r["against"]): r for r in rows}
    t = by[(0.5, "TPOT p50 ms", "transformers-serve")]
    assert t["ratio"] == pytest.approx(41 / 37.5) and (t["min"], t["max"]) == pytest.approx((40 / 37, 42 / 38))
    assert t["met"] is True  # <= 1.1x
    p99 = by[(0.5, "TPOT p99 ms", "transformers-serve")]
    assert p99["ratio"] == pytest.approx(80 / 42) and p99["met"] is True  # <= 2x
    ttft = by[(0.5, "TTFT p50 ms", "transformers-serve")]
    assert ttft["ratio"] == pytest.approx(680 / 3200) and ttft["met"] is True
    g = by[(1.0, "SLO goodput req/s", "transformers-serve")]
    assert g["ratio"] == pytest.approx(0.25 / 0.075) and (g["min"], g["max"]) == pytest.approx((3.0, 4.0)) and g["met"]
    assert not any(r["against"].startswith("reference") for r in rows)  # no reference given
    md = ratio_table(rows)
    assert "| 0.5/s | epdserve-monolithic | TPOT p50 ms | transformers-serve | 1.09x | 1.08x-1.11x | <= 1.1x | yes |" in md


def test_reference_run_is_todays_monolithic():
    new = _part("epdserve-E-PD", [(1.0, _m(1200, 50, 90, 200, 0.40, good=20)), (1.0, _m(1300, 55, 95, 210, 0.36))])
    rows = ratio_rows(merge_reports([PEER, new]), "transformers-serve", reference=merge_reports([PEER, MONO]))
    ref = next(r for r in rows if r["against"] == "reference epdserve-monolithic")
    assert ref["ratio"] == pytest.approx(0.38 / 0.25) and ref["met"] is True  # >= 1.3x
    assert (ref["min"], ref["max"]) == pytest.approx((0.40 / 0.30, 0.36 / 0.20))


def test_todays_monolithic_from_the_same_run():
    """--today: a target of this run is the reference; it is not compared with itself."""
    today = _part("epdserve-monolithic#no-budget", [(1.0, _m(500, 70, 190, 1100, 0.20)), (1.0, _m(500, 70, 190, 1100, 0.25))])
    rep = merge_reports([PEER, MONO, today])
    rows = ratio_rows(rep, "transformers-serve", rep, reference_label="epdserve-monolithic#no-budget")
    refs = [r for r in rows if r["against"].startswith("reference")]
    assert [r["target"] for r in refs] == ["epdserve-monolithic"]
    assert refs[0]["ratio"] == pytest.approx(0.25 / 0.225) and refs[0]["met"] is False


def test_aim_edges():
    assert Aim(1.0, "SLO goodput req/s", ">=", 2.0).met(math.inf) is True
    assert Aim(0.5, "TTFT p50 ms", "<=", 0.5).met(None) is None
    assert {a.rate for a in AIMS} == {0.5, 1.0}
    assert "no ratio" in ratio_table([])


def test_vllm_aims_take_a_burst_s_output_rate_and_light_load_latencies():
    """Against vLLM (issue 50): TTFT and TPOT p50 at 1 req/s <= 0.9x, output tok/s at rate inf >= 1.2x."""
    def run(rate, ttft, tpot, tok_s):
        return rate, {**_m(ttft, tpot, tpot, tpot, 0.5), "output_throughput": tok_s}
    vllm = _part("vllm", [run(1.0, 100, 9.0, 30), run(math.inf, 5000, 80, 400), run(1.0, 110, 8.0, 31),
                          run(math.inf, 6000, 90, 700)])
    ours = _part("epdserve-monolithic", [run(1.0, 80, 9.5, 30), run(math.inf, 4000, 70, 600),
                                         run(1.0, 90, 7.5, 31), run(math.inf, 4000, 75, 600)])
    rows = {(r["rate"], r["figure"]): r for r in ratio_rows(merge_reports([vllm, ours]), "vllm", aims=VLLM_AIMS)}
    assert rows[(1.0, "TTFT p50 ms")]["ratio"] == pytest.approx(85 / 105) and rows[(1.0, "TTFT p50 ms")]["met"]
    assert rows[(1.0, "TPOT p50 ms")]["ratio"] == pytest.approx(8.5 / 8.5) and not rows[(1.0, "TPOT p50 ms")]["met"]
    burst = rows[(math.inf, "output tok/s")]
    assert burst["ratio"] == pytest.approx(600 / 550) and burst["met"] is False  # < 1.2x
    assert (burst["min"], burst["max"]) == pytest.approx((600 / 700, 600 / 400))
    assert "| inf/s | epdserve-monolithic | output tok/s | vllm | 1.09x |" in ratio_table(list(rows.values()))
