"""Arrival schedules of a serving workload: when each request is sent.

`arrival_times(n, rate, burstiness, seed)`: gamma inter-arrivals (shape = burstiness, 1 = Poisson),
the same offsets for the same arguments. `bench serve` sends on them; the planner simulates them.
"""
from __future__ import annotations

import math

import numpy as np


def arrival_times(n: int, rate: float, burstiness: float = 1.0, seed: int = 0) -> list[float]:
    """Send offsets (s from the start) of n requests: gamma inter-arrivals with shape `burstiness`
    and mean 1/rate (burstiness 1 = Poisson; < 1 burstier; > 1 more regular). The first request
    goes at 0. rate = inf: all at once."""
    if n < 1:
        return []
    if rate <= 0 or burstiness <= 0:
        raise ValueError("rate and burstiness must be > 0")
    if math.isinf(rate):
        return [0.0] * n
    gaps = np.random.default_rng(seed).gamma(shape=burstiness, scale=1.0 / (rate * burstiness), size=n - 1)
    return [0.0, *np.cumsum(gaps).tolist()]
