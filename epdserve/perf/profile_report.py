"""The profile report (`epdserve profile`'s JSON) and reading costs off it.

The report is one JSON object with "benchmark": "profile" and, among others:
- "vision": per image size, {"resolution", "width", "height", "vision_tokens", "preprocess_ms",
  "encode_ms", "feature_bytes", ...};
- "prefill": per prompt length, {"prompt_tokens", "prefill_ms", ...};
- "decode": per batch size, {"batch_size", "decode_ms_per_step", "context_tokens", ...};
- "kv_bytes_per_token", "text_tokens_per_request", "per_request" (bytes moved per request),
  "unloaded_ttft" (`unloaded_ttft` below).
`interp` reads a cost between (and past) the measured points; the planner's cost curves and
`unloaded_ttft` use it. Pure Python: no torch, no engine.
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


def unloaded_ttft(report: dict) -> list[dict]:
    """Estimated TTFT of one request alone on one device, per image size: preprocess + encode +
    prefill of (vision + text) tokens, from the measured points. The floor any SLO must clear."""
    xs = [p["prompt_tokens"] for p in report["prefill"]]
    ys = [p["prefill_ms"] for p in report["prefill"]]
    text = report["text_tokens_per_request"]
    rows = [{"request": "text-only", "prompt_tokens": text, "ttft_ms": interp(xs, ys, text)}]
    for v in report["vision"]:
        n = v["vision_tokens"] + text
        rows.append({"request": f"1 x {v['resolution']}", "prompt_tokens": n,
                     "ttft_ms": v["preprocess_ms"] + v["encode_ms"] + interp(xs, ys, n)})
    return rows
