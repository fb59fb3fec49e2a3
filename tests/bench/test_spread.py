"""Ratio intervals of `bench serve` (bench/spread.py): a bootstrap over each run's requests."""
from __future__ import annotations

from epdserve.bench.spread import fmt_ratio, goodput_ratio_interval, median_ratio_interval, within_noise

SLO = {"ttft_ms": 1000.0, "tpot_ms": 100.0}


def _rows(n_good: int, n_bad: int) -> list[dict]:
    good = [{"ok": True, "ttft_ms": 500.0 + i, "tpot_ms": 50.0} for i in range(n_good)]
    bad = [{"ok": True, "ttft_ms": 2000.0 + i, "tpot_ms": 50.0} for i in range(n_bad)]
    return good + bad


def test_a_clear_difference_is_outside_noise_and_a_run_against_its_twin_is_within():
    ci = goodput_ratio_interval(_rows(38, 2), _rows(10, 30), 40.0, 40.0, SLO)
    assert ci is not None and ci[0] > 1.0 and not within_noise(ci)
    twin = goodput_ratio_interval(_rows(20, 20), _rows(20, 20), 40.0, 40.0, SLO)
    assert within_noise(twin) and twin[0] < 1.0 < twin[1]
    assert goodput_ratio_interval(_rows(5, 0), _rows(0, 5), 10.0, 10.0, SLO) is None  # zero baseline goodput


def test_median_ratio_interval_and_format():
    a, b = [100.0 + i for i in range(40)], [200.0 + i for i in range(40)]
    lo, hi = median_ratio_interval(a, b)
    assert lo <= 120.0 / 220.0 and hi >= 119.0 / 219.0 and hi < 1.0
    assert fmt_ratio(0.5, (0.4, 0.6)) == "0.50x (0.40-0.60)"
    assert fmt_ratio(1.1, (0.9, 1.3)) == "1.10x (0.90-1.30, within noise)"
    assert fmt_ratio(None, None) == "-"
