"""The spread of a ratio between two serving runs, from their per-request rows (bootstrap).

`bench serve` runs each cell once with many requests; its ratios against the baseline (goodput,
TTFT p50) get a 95% interval by resampling each run's requests with replacement (the runs'
durations held fixed) and taking the 2.5th and 97.5th percentiles of the resampled ratio.
A ratio whose interval contains 1 is within noise: the run cannot tell the two apart.
Seeded, so a report is reproducible from its JSON.
"""
from __future__ import annotations

import math
import statistics

import numpy as np

RESAMPLES = 2000


def _good(rows: list[dict], slo: dict) -> np.ndarray:
    ttft, tpot = slo.get("ttft_ms"), slo.get("tpot_ms")
    out = []
    for r in rows:
        ok = bool(r.get("ok"))
        if ok and ttft is not None and (r.get("ttft_ms") is None or r["ttft_ms"] > ttft):
            ok = False
        if ok and tpot is not None and (r.get("tpot_ms") or 0.0) > tpot:
            ok = False
        out.append(ok)
    return np.array(out, dtype=float)


def goodput_ratio_interval(rows: list[dict], base_rows: list[dict], duration_s: float, base_duration_s: float,
                           slo: dict, seed: int = 0) -> tuple[float, float] | None:
    """95% interval of goodput(rows) / goodput(base_rows); None when either side is empty or zero."""
    a, b = _good(rows, slo), _good(base_rows, slo)
    if not len(a) or not len(b) or duration_s <= 0 or base_duration_s <= 0:
        return None
    rng = np.random.default_rng(seed)
    ga = a[rng.integers(0, len(a), (RESAMPLES, len(a)))].sum(axis=1) / duration_s
    gb = b[rng.integers(0, len(b), (RESAMPLES, len(b)))].sum(axis=1) / base_duration_s
    keep = gb > 0
    if keep.mean() < 0.95:
        return None
    r = ga[keep] / gb[keep]
    return float(np.percentile(r, 2.5)), float(np.percentile(r, 97.5))


def median_ratio_interval(values: list[float], base_values: list[float], seed: int = 0) -> tuple[float, float] | None:
    """95% interval of median(values) / median(base_values)."""
    a, b = np.array([v for v in values if v is not None]), np.array([v for v in base_values if v is not None])
    if not len(a) or not len(b):
        return None
    rng = np.random.default_rng(seed)
    ma = np.median(a[rng.integers(0, len(a), (RESAMPLES, len(a)))], axis=1)
    mb = np.median(b[rng.integers(0, len(b), (RESAMPLES, len(b)))], axis=1)
    if (mb <= 0).any():
        return None
    r = ma / mb
    return float(np.percentile(r, 2.5)), float(np.percentile(r, 97.5))


def within_noise(interval: tuple[float, float] | None) -> bool:
    return interval is not None and interval[0] <= 1.0 + 1e-9 and interval[1] >= 1.0 - 1e-9


def fmt_ratio(value: float | None, interval: tuple[float, float] | None, nd: int = 2) -> str:
    """'1.21x (1.05-1.38)', with ', within noise' when the interval contains 1."""
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return "-"
    if math.isinf(value):
        return "inf"
    s = f"{value:.{nd}f}x"
    if interval is None:
        return s
    return s + f" ({interval[0]:.{nd}f}-{interval[1]:.{nd}f}{', within noise' if within_noise(interval) else ''})"


def median(values: list[float]) -> float | None:
    vals = [v for v in values if v is not None]
    return statistics.median(vals) if vals else None
