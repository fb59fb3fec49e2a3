"""The CPU cores a process may use, and their split into disjoint sets — shared by the
instance's co-located stage workers (instance/affinity.py) and a tensor-parallel instance's CPU
ranks (engine/tp/group.py `rank_cores`)."""
from __future__ import annotations

import os


def available_cores() -> list[int]:
    """Cores this process may run on, sorted."""
    if hasattr(os, "sched_getaffinity"):
        return sorted(os.sched_getaffinity(0))
    return list(range(os.cpu_count() or 1))


def split_cores(n_workers: int, cores: list[int] | None = None, weights: list[float] | None = None) -> list[list[int]]:
    """Split `cores` into `n_workers` disjoint, contiguous, non-empty sets (by `weights`).

    With fewer cores than workers every worker gets all cores (sharing is the only option).
    """
    if n_workers < 1:
        raise ValueError(f"n_workers must be >= 1, got {n_workers}")
    cores = sorted(cores if cores is not None else available_cores())
    if not cores:
        raise ValueError("no cores to split")
    weights = list(weights) if weights is not None else [1.0] * n_workers
    if len(weights) != n_workers or any(w <= 0 for w in weights):
        raise ValueError(f"need {n_workers} positive weights, got {weights}")
    if len(cores) < n_workers:
        return [list(cores) for _ in range(n_workers)]
    total = sum(weights)
    # Each worker gets at least one core; the rest follow the weights (largest remainder).
    spare = len(cores) - n_workers
    shares = [w / total * spare for w in weights]
    counts = [1 + int(s) for s in shares]
    leftover = len(cores) - sum(counts)
    for i in sorted(range(n_workers), key=lambda i: shares[i] - int(shares[i]), reverse=True)[:leftover]:
        counts[i] += 1
    out, start = [], 0
    for c in counts:
        out.append(cores[start : start + c])
        start += c
    return out
