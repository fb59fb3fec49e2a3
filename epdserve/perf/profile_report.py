"""The profile report (`epdserve profile`'s JSON) and reading costs off it.

The report is one JSON object with "benchmark": "profile" and, among others:
- "vision": per image size, {"resolution", "width", "height", "vision_tokens", "preprocess_ms",
  "encode_ms", "feature_bytes", ...};
- "prefill": per prompt length, {"prompt_tokens", "prefill_ms", ...};
- "decode": per batch size, {"batch_size", "decode_ms_per_step", "context_tokens", ...};
- "kv_bytes_per_token", "text_tokens_per_request", "per_request" (bytes moved per request),
  "unloaded_ttft" (`unloaded_ttft` below).
`interp` reads a value between (and past) the measured points; `cost_at` is the one reading of a
*cost* off them (never below zero: a line extrapolated from two noisy points can cross it), which the
planner's cost curves and `unloaded_ttft` both use. Pure Python: no torch, no engine.
"""
from __future__ import annotations


def interp(xs: list[float], ys: list[float], x: float) -> float:
    """Piecewise-linear y(x) through the measured points, extended linearly past the ends."""
    pts = sorted(zip(xs, ys))
    if len(pts) == 1:
        return pts[0][1] * x / pts[0][0] if pts[0][0] else pts[0][1]
    for (x0, y0), (x1, y1) in zip(pts, pts[1:]):
        if x <= x1 or (x1, y1) == pts[-1]:
            return y0 + (y1 - y0) * (x - x0) / (x1 - x0) if x1 != x0 else y1
    return pts[-1][1]


def cost_at(xs: list[float], ys: list[float], x: float) -> float:
    """A cost (ms) at x read off measured points: `interp`, 0 at x <= 0, and never below zero."""
    if x <= 0:
        return 0.0
    return max(0.0, interp(xs, ys, x))


def unloaded_ttft(report: dict) -> list[dict]:
    """Estimated TTFT of one request alone on one device, per image size: preprocess + encode +
    prefill of (vision + text) tokens, from the measured points. The floor any SLO must clear.

    Each row carries its parts ("preprocess_ms", "encode_ms", "prefill_ms"; "ttft_ms" is their sum):
    preprocess and encode are the measured figures of that image size, prefill is read off the
    prefill points with `cost_at` (so it is never negative)."""
    xs = [p["prompt_tokens"] for p in report["prefill"]]
    ys = [p["prefill_ms"] for p in report["prefill"]]
    text = report["text_tokens_per_request"]
    stages = [("text-only", text, 0.0, 0.0)]
    stages += [(f"1 x {v['resolution']}", v["vision_tokens"] + text, v["preprocess_ms"], v["encode_ms"])
               for v in report["vision"]]
    rows = []
    for request, n, preprocess_ms, encode_ms in stages:
        prefill_ms = cost_at(xs, ys, n)
        rows.append({"request": request, "prompt_tokens": n, "preprocess_ms": preprocess_ms,
                     "encode_ms": encode_ms, "prefill_ms": prefill_ms,
                     "ttft_ms": preprocess_ms + encode_ms + prefill_ms})
    return rows
