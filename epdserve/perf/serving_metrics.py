"""Serving metrics from client-side records, with the definitions of vLLM's and SGLang's serving benchmarks.

Owns `RequestRecord` (what the client saw of one request: monotonic send time, the time and token
count of every streamed message, usage, the server's stage timestamps) and the pure
functions that turn a list of records into the report's numbers:
- TTFT = first message carrying >= 1 output token - t0; E2EL = last message - t0;
- TPOT = (E2EL - TTFT) / (N_out - 1), only when N_out > 1 (counts as 0 for goodput);
- ITL = every gap between consecutive token-carrying messages, pooled over requests (a final
  message with no tokens, only usage, adds no gap); a request's longest gap (`itl_max`, the worst
  stall its stream saw) is also kept, one value per request;
- duration = last completion - first dispatch; throughputs over it (input tokens = text + vision);
- goodput = requests meeting every SLO / duration; SLO attainment = that count / all requests;
  slo_missed = how many completed requests missed each objective (one may miss two);
  (failures are misses); output tok/s under the SLO = output tokens of those requests / duration
  (EPD-Serve's Table 2 figure);
- mean, median (also as p50), p90, p95, p99, max of each (numpy's linear percentile): TPOT's are
  over requests, ITL's over all gaps; failures; peak output tok/s over 1 s windows;
- the TTFT split by stage from the server's timestamps (`stage_breakdown`).
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np

from epdserve.slo import SLO  # the objectives, declared once (epdserve/slo.py)

PERCENTILES = (90, 95, 99)

# Server timestamps on the way to the first token, in order; a segment is named by its end.
TTFT_STAGES = (("dispatched", "queue"), ("encode_start", "encode wait"), ("encode_end", "encode"),
               ("prefill_start", "E->P / P queue"), ("first_token", "prefill"))
# After the first token (they shape the first inter-token gap, not TTFT).
POST_STAGES = (("first_token", "kv_transfer_end", "P->D"), ("kv_transfer_end", "first_decode", "first decode"))


@dataclass
class RequestRecord:
    request_id: str
    t0: float  # time.monotonic() just before the RPC was issued
    kind: str = "image"  # "image" | "text"
    num_images: int = 0
    t0_wall: float = 0.0  # time.time() at t0, to line the server's Unix timestamps up with t0
    chunk_times: list[float] = field(default_factory=list)  # monotonic time of each message with tokens
    chunk_tokens: list[int] = field(default_factory=list)  # tokens in each of those messages
    end: float | None = None  # monotonic time of the last message (or of the failure)
    success: bool = False
    error: str = ""
    expected_output_tokens: int = 0  # max_tokens asked for (ignore_eos: what a full answer has)
    prompt_tokens: int = 0
    prompt_text_tokens: int = 0
    vision_tokens: int = 0
    cached_vision_tokens: int = 0
    output_tokens: int = 0  # from usage; falls back to the tokens counted in the stream
    cached_tokens: int | None = None  # prompt tokens whose KV the server reused (None: not reported)
    output_text: str = ""  # the streamed text (a multi-turn history is built from it)
    turn: int | None = None  # multi-turn workloads: the request's turn, from 1
    timing: dict[str, float] = field(default_factory=dict)  # server stage timestamps (Unix s, 0 = absent)

    @property
    def n_out(self) -> int:
        return self.output_tokens or sum(self.chunk_tokens)

    @property
    def ttft(self) -> float | None:
        return self.chunk_times[0] - self.t0 if self.success and self.chunk_times else None

    @property
    def e2el(self) -> float | None:
        return self.end - self.t0 if self.success and self.end is not None else None

    @property
    def tpot(self) -> float | None:
        if not self.success or self.n_out <= 1 or self.ttft is None:
            return None
        return (self.e2el - self.ttft) / (self.n_out - 1)

    @property
    def itls(self) -> list[float]:
        if not self.success:
            return []
        return [b - a for a, b in zip(self.chunk_times, self.chunk_times[1:])]

    @property
    def itl_max(self) -> float | None:
        """The longest gap between two of this request's token messages (None with fewer than two)."""
        return max(self.itls, default=None)


def stats(values, scale: float = 1e3) -> dict:
    """mean/median/p50/p90/p95/p99/max (and count, std, min) of `values`, times `scale` (s → ms);
    p50 is the median under its percentile name."""
    v = np.asarray([x for x in values if x is not None], dtype=float) * scale
    if v.size == 0:
        return {"count": 0, **{k: None for k in ("mean", "std", "min", "median", "p50", "p90", "p95", "p99", "max")}}
    out = {"count": int(v.size), "mean": float(v.mean()), "std": float(v.std()), "min": float(v.min()),
           "median": float(np.median(v)), "p50": float(np.percentile(v, 50))}
    out.update({f"p{p}": float(np.percentile(v, p)) for p in PERCENTILES})
    out["max"] = float(v.max())
    return out


def peak_output_tps(records: list[RequestRecord], window: float = 1.0) -> float:
    """Most output tokens received within one `window`-second bucket (buckets from first dispatch)."""
    start = min((r.t0 for r in records), default=0.0)
    buckets: dict[int, int] = {}
    for r in records:
        if not r.success:
            continue
        for t, n in zip(r.chunk_times, r.chunk_tokens):
            b = int((t - start) // window)
            buckets[b] = buckets.get(b, 0) + n
    return max(buckets.values(), default=0) / window


def duration(records: list[RequestRecord]) -> float:
    ends = [r.end for r in records if r.end is not None]
    if not records or not ends:
        return 0.0
    return max(ends) - min(r.t0 for r in records)


def compute_metrics(records: list[RequestRecord], slo: SLO, by_kind: bool = True) -> dict:
    """Every serving metric of one run (times in ms, rates per second)."""
    ok = [r for r in records if r.success]
    dur = duration(records)
    per_s = (lambda x: x / dur) if dur > 0 else (lambda x: 0.0)
    text_in = sum(r.prompt_text_tokens or max(0, r.prompt_tokens - r.vision_tokens) for r in ok)
    vision_in = sum(r.vision_tokens for r in ok)
    out_tokens = sum(r.n_out for r in ok)
    good = sum(1 for r in records if slo.met(r))
    m = {
        "num_requests": len(records), "completed": len(ok), "failed": len(records) - len(ok),
        "errors": sorted({r.error for r in records if not r.success and r.error})[:10],
        "duration_s": dur,
        "input_text_tokens": text_in, "input_vision_tokens": vision_in,
        "cached_vision_tokens": sum(r.cached_vision_tokens for r in ok), "output_tokens": out_tokens,
        "incomplete_outputs": sum(1 for r in ok if r.expected_output_tokens and r.n_out < r.expected_output_tokens),
        "request_throughput": per_s(len(ok)), "output_throughput": per_s(out_tokens),
        "input_throughput": per_s(text_in + vision_in), "input_text_throughput": per_s(text_in),
        "input_vision_throughput": per_s(vision_in), "total_token_throughput": per_s(text_in + vision_in + out_tokens),
        "peak_output_throughput": peak_output_tps(records),
        "slo": slo.to_dict(), "good_requests": good, "goodput": per_s(good),
        "output_throughput_under_slo": per_s(sum(r.n_out for r in records if slo.met(r))),
        "slo_attainment": good / len(records) if records else 0.0,
        "slo_missed": {k: sum(1 for r in ok if k in slo.missed(r)) for k in ("ttft", "tpot", "e2el")},
        "ttft_ms": stats(r.ttft for r in ok), "tpot_ms": stats(r.tpot for r in ok),
        "itl_ms": stats(x for r in ok for x in r.itls), "itl_max_ms": stats(r.itl_max for r in ok),
        "e2el_ms": stats(r.e2el for r in ok),
        "stages_ms": stage_breakdown(ok),
    }
    if by_kind:
        kinds = sorted({r.kind for r in records})
        if len(kinds) > 1:
            m["by_kind"] = {k: compute_metrics([r for r in records if r.kind == k], slo, by_kind=False) for k in kinds}
    return m


def ttft_segments(r: RequestRecord) -> dict[str, float]:
    """One request's TTFT split (seconds): client→server, the server's stages up to the first token
    (a stage with no timestamp is folded into the next one that has one), server→client."""
    t = r.timing or {}
    arrival = t.get("arrival") or 0.0
    if not arrival or not t.get("first_token") or r.ttft is None:
        return {}
    seg = {"send": max(0.0, arrival - r.t0_wall) if r.t0_wall else 0.0}
    prev = arrival
    for key, name in TTFT_STAGES:
        stamp = t.get(key) or 0.0
        if stamp <= 0:
            continue
        seg[name] = max(0.0, stamp - prev)
        prev = max(prev, stamp)
    seg["return"] = max(0.0, r.ttft - seg["send"] - (prev - arrival))
    return seg


def post_first_token_segments(r: RequestRecord) -> dict[str, float]:
    t = r.timing or {}
    return {name: t[b] - t[a] for a, b, name in POST_STAGES if (t.get(a) or 0) > 0 and (t.get(b) or 0) > 0}


def stage_breakdown(records: list[RequestRecord]) -> dict:
    """Per stage: mean and median ms over the requests whose timestamps cover it, plus `share`
    (mean over all records with timestamps, so the TTFT stages' shares add up to mean TTFT)."""
    rows = [ttft_segments(r) for r in records]
    rows = [s for s in rows if s]
    post = [post_first_token_segments(r) for r in records]
    out: dict = {"requests_with_timings": len(rows)}
    names = ["send", *(n for _, n in TTFT_STAGES), "return"]
    for name in names:
        vals = [s[name] for s in rows if name in s]
        if vals:
            out[name] = {"mean": 1e3 * float(np.mean(vals)), "median": 1e3 * float(np.median(vals)),
                         "share_of_mean_ttft": 1e3 * sum(vals) / len(rows), "count": len(vals)}
    for _, _, name in POST_STAGES:
        vals = [p[name] for p in post if name in p]
        if vals:
            out[name] = {"mean": 1e3 * float(np.mean(vals)), "median": 1e3 * float(np.median(vals)),
                         "count": len(vals)}
    return out


def max_rate_meeting_slo(sweep: list[tuple[float, dict]], quantile: str = "p99", slo: SLO | None = None) -> float | None:
    """The highest request rate whose `quantile` TTFT and TPOT meet the SLO and that had no failures."""
    best = None
    for rate, m in sweep:
        s = slo or SLO.from_dict(m["slo"])
        ttft, tpot = m["ttft_ms"].get(quantile), m["tpot_ms"].get(quantile)
        fine = m["failed"] == 0 and ttft is not None
        fine = fine and (s.ttft_ms is None or ttft <= s.ttft_ms)
        fine = fine and (s.tpot_ms is None or tpot is None or tpot <= s.tpot_ms)
        if fine and not math.isinf(rate) and (best is None or rate > best):
            best = rate
    return best
