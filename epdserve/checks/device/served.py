"""The served TPOT of one request alone (`bench device` part perf): `epdserve launch --mode
monolithic` on the device, one streaming request at a time, its time per output token after the
first as the client sees it.

Owns `served_tpot_ms`: per request, the server's TPOT from its own stamps ((finished − first
token) / (tokens − 1): `served_tpot_b1_ms`) and the client's ((arrival of the last token − arrival
of the first delta) / tokens after it: `served_client_tpot_b1_ms`; tokens the server joined into
one message count as arriving together); medians over `repeats` requests, after a warm-up one.
"""
from __future__ import annotations

import os
import statistics
import time

from epdserve.checks.device.env import TEXT, CheckConfig


def one_stream_tpot_ms(client, tokens: int) -> tuple[float | None, float | None]:
    """(server TPOT ms, client TPOT ms) of one streamed greedy request of `tokens` tokens."""
    first_t, first_n, last_t, n, timing = None, 0, None, 0, None
    for delta in client.generate_stream(TEXT, max_tokens=tokens, temperature=0.0, ignore_eos=True):
        timing = delta.timing or timing
        if not delta.token_ids:
            continue
        now = time.perf_counter()
        n += len(delta.token_ids)
        if first_t is None:
            first_t, first_n = now, n
        last_t = now
    client_ms = (last_t - first_t) / (n - first_n) * 1e3 if first_t is not None and n > first_n else None
    server_ms = None
    if timing is not None and timing.finished and timing.first_token and n > 1:
        server_ms = (timing.finished - timing.first_token) / (n - 1) * 1e3
    return server_ms, client_ms


def _median(xs) -> float | None:
    xs = [x for x in xs if x is not None]
    return round(statistics.median(xs), 2) if xs else None


def served_tpot_ms(cfg: CheckConfig, model: str, dtype: str, tokens: int, repeats: int = 3) -> dict:
    """{"served_tpot_b1_ms", "served_client_tpot_b1_ms", "served_ready_s"} of a monolithic deployment
    of `model` in `dtype`."""
    from epdserve.deploy.local.launched import launched
    from epdserve.client import Client

    logs = os.path.join(cfg.work_dir, "perf-logs")
    os.makedirs(logs, exist_ok=True)
    extra = ["--device", cfg.device, "--instance-args", f"--dtype {dtype}"]
    with launched("monolithic", model, extra, ready_timeout_s=max(5.0, cfg.left_s() - 20.0), log_dir=logs) as dep:
        with Client(dep.address, timeout=300.0) as c:
            one_stream_tpot_ms(c, 4)  # warm-up
            runs = [one_stream_tpot_ms(c, tokens) for _ in range(repeats)]
    return {"served_tpot_b1_ms": _median(r[0] for r in runs), "served_client_tpot_b1_ms": _median(r[1] for r in runs),
            "served_ready_s": round(dep.ready_s, 1)}
