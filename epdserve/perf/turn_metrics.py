"""Per-turn serving metrics of a multi-turn run: what the prefix cache changes, turn by turn.

Owns `turn_metrics(records, slo)`: the records grouped by their `turn` (from 1), each turn's
TTFT statistics, requests, failures and mean prompt tokens, plus its cached prompt tokens (sum
and share of the prompt) when the server reported them (`RequestRecord.cached_tokens`; absent
otherwise); and the same for turn 1 against turns >= 2 together (`first`, `later`), with TPOT and
goodput's SLO attainment, and `later_over_first`, turns >= 2 TTFT p50 over turn 1's. Times in ms.
Pure: records in, a JSON-ready dict out.
"""
from __future__ import annotations

from epdserve.perf.serving_metrics import SLO, RequestRecord, stats


def _group(records: list[RequestRecord], slo: SLO) -> dict:
    ok = [r for r in records if r.success]
    out = {"requests": len(records), "completed": len(ok), "ttft_ms": stats(r.ttft for r in ok),
           "tpot_ms": stats(r.tpot for r in ok),
           "slo_attainment": sum(1 for r in records if slo.met(r)) / len(records) if records else 0.0,
           "prompt_tokens_mean": (sum(r.prompt_tokens for r in ok) / len(ok)) if ok else None}
    reported = [r for r in ok if r.cached_tokens is not None]
    if reported:
        cached, prompt = sum(r.cached_tokens for r in reported), sum(r.prompt_tokens for r in reported)
        out["cached_tokens"] = cached
        out["cached_tokens_mean"] = cached / len(reported)
        out["cached_share"] = cached / prompt if prompt else None
    return out


def turn_metrics(records: list[RequestRecord], slo: SLO) -> dict:
    """{"per_turn": [{"turn": 1, ...}, ...], "first": {...}, "later": {...}, "later_over_first": x}."""
    turns = sorted({r.turn for r in records if r.turn is not None})
    per_turn = [{"turn": t, **_group([r for r in records if r.turn == t], slo)} for t in turns]
    first = _group([r for r in records if r.turn == 1], slo)
    later = _group([r for r in records if r.turn is not None and r.turn >= 2], slo)
    a, b = later["ttft_ms"]["p50"], first["ttft_ms"]["p50"]
    return {"per_turn": per_turn, "first": first, "later": later,
            "later_over_first": (a / b) if a is not None and b else None}
