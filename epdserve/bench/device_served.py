"""The served TPOT of one request alone (`bench device` part perf): `epdserve launch --mode
monolithic` on the device, one streaming request at a time, its time per output token after the
first as the client sees it.

Owns `served_tpot_ms`: per request, (arrival of the last token − arrival of the first) / (tokens
after the first delta); the median over `repeats` requests, after one warm-up request.
"""
from __future__ import annotations

import os
import statistics
import time

from epdserve.bench.device_env import TEXT, CheckConfig


def one_stream_tpot_ms(client, tokens: int) -> float | None:
    first_t, first_n, last_t, n = None, 0, None, 0
    for delta in client.generate_stream(TEXT, max_tokens=tokens, temperature=0.0, ignore_eos=True):
        if not delta.token_ids:
            continue
        now = time.perf_counter()
        n += len(delta.token_ids)
        if first_t is None:
            first_t, first_n = now, n
        last_t = now
    if first_t is None or n <= first_n:
        return None
    return (last_t - first_t) / (n - first_n) * 1e3


def served_tpot_ms(cfg: CheckConfig, model: str, dtype: str, tokens: int, repeats: int = 3) -> dict:
    """{"served_tpot_b1_ms", "ready_s"} of a monolithic deployment of `model` in `dtype`."""
    from epdserve.bench.serve_launch import launched
    from epdserve.client import Client

    logs = os.path.join(cfg.work_dir, "perf-logs")
    os.makedirs(logs, exist_ok=True)
    extra = ["--device", cfg.device, "--instance-args", f"--dtype {dtype}"]
    with launched("monolithic", model, extra, ready_timeout_s=max(5.0, cfg.left_s() - 20.0), log_dir=logs) as dep:
        with Client(dep.address, timeout=300.0) as c:
            one_stream_tpot_ms(c, 4)  # warm-up
            runs = [one_stream_tpot_ms(c, tokens) for _ in range(repeats)]
    runs = [r for r in runs if r is not None]
    return {"served_tpot_b1_ms": round(statistics.median(runs), 2) if runs else None,
            "served_ready_s": round(dep.ready_s, 1)}
