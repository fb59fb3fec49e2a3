"""Stage costs of one device, fitted to an `epdserve profile` JSON report.

`CostModel` answers, in ms: `encode_ms(vision_tokens)` (one vision-tower call over that many
tokens, images batched), `preprocess_ms(vision_tokens)` (JPEG decode + image processor, done by
the scheduler), `prefill_ms(prompt_tokens)`, `decode_ms(batch_size)` (one step of a continuous
batch at the profile's decode context) and `transfer_ms(bytes)` over a link of `link_gbps` GB/s
plus a fixed latency. Each function is piecewise linear through the measured points and extended
linearly past the ends, never below zero (`perf.profile_report.cost_at`). Byte counts come from the
profile too: feature bytes per vision token (E→P) and KV bytes per prompt token (P→D).
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from epdserve.perf.profile_report import cost_at
from epdserve.planner.reports import read_report

DEFAULT_LINK_GBPS = 1.0  # loopback gloo / Redis on one CPU host (README 'Layerwise P→D KV transfer')
DEFAULT_LINK_LATENCY_MS = 1.0


class ProfileError(ValueError):
    """The profile file is missing, unreadable or lacks a stage's measurements."""


@dataclass(frozen=True)
class Curve:
    """y(x), piecewise linear through measured (x, y) points, linear past the ends, >= 0."""

    xs: tuple[float, ...]
    ys: tuple[float, ...]

    def __call__(self, x: float) -> float:
        return cost_at(list(self.xs), list(self.ys), x)


@dataclass(frozen=True)
class CostModel:
    encode: Curve
    preprocess: Curve
    prefill: Curve
    decode: Curve
    feature_bytes_per_token: float
    kv_bytes_per_token: float
    link_gbps: float = DEFAULT_LINK_GBPS
    link_latency_ms: float = DEFAULT_LINK_LATENCY_MS
    source: str = ""

    def encode_ms(self, vision_tokens: int) -> float:
        return self.encode(vision_tokens)

    def preprocess_ms(self, vision_tokens: int) -> float:
        return self.preprocess(vision_tokens)

    def prefill_ms(self, prompt_tokens: int) -> float:
        return self.prefill(prompt_tokens)

    def decode_ms(self, batch_size: int) -> float:
        return self.decode(batch_size) if batch_size > 0 else 0.0

    def transfer_ms(self, nbytes: float) -> float:
        if nbytes <= 0:
            return 0.0
        return self.link_latency_ms + nbytes / (self.link_gbps * 1e9) * 1e3

    def feature_transfer_ms(self, vision_tokens: int) -> float:
        return self.transfer_ms(vision_tokens * self.feature_bytes_per_token)

    def kv_transfer_ms(self, prompt_tokens: int) -> float:
        return self.transfer_ms(prompt_tokens * self.kv_bytes_per_token)

    @classmethod
    def from_report(cls, report: dict, link_gbps: float = DEFAULT_LINK_GBPS,
                    link_latency_ms: float = DEFAULT_LINK_LATENCY_MS, source: str = "") -> CostModel:
        if link_gbps <= 0 or link_latency_ms < 0:
            raise ProfileError("link bandwidth must be > 0 and latency >= 0")
        try:
            vision = report["vision"]
            prefill = report["prefill"]
            decode = report["decode"]
            kv_tok = float(report["kv_bytes_per_token"])
            if not (vision and prefill and decode):
                raise KeyError("vision/prefill/decode")
            tok = [float(v["vision_tokens"]) for v in vision]
            model = cls(
                encode=Curve(tuple(tok), tuple(float(v["encode_ms"]) for v in vision)),
                preprocess=Curve(tuple(tok), tuple(float(v.get("preprocess_ms", 0.0)) for v in vision)),
                prefill=Curve(tuple(float(p["prompt_tokens"]) for p in prefill), tuple(float(p["prefill_ms"]) for p in prefill)),
                decode=Curve(tuple(float(d["batch_size"]) for d in decode),
                             tuple(float(d["decode_ms_per_step"]) for d in decode)),
                feature_bytes_per_token=sum(float(v["feature_bytes"]) for v in vision) / sum(tok),
                kv_bytes_per_token=kv_tok, link_gbps=link_gbps, link_latency_ms=link_latency_ms, source=source)
        except (KeyError, TypeError, ValueError, ZeroDivisionError) as e:
            raise ProfileError(f"{source or 'profile'}: not an `epdserve profile` report ({type(e).__name__}: {e})") from None
        return model

    @classmethod
    def load(cls, path: str | Path, **kw) -> tuple[CostModel, dict]:
        """(cost model, the raw report) of a profile JSON file."""
        report = read_report(path, "profile", ProfileError, "profile", "`epdserve profile` report",
                             f" (write one with `epdserve profile --model DIR --out {path}`)")
        return cls.from_report(report, source=str(path), **kw), report


def degree_of(report: dict) -> int:
    """The tensor-parallel degree a profile was measured at (reports before degrees: 1)."""
    return int(report.get("tensor_parallel_size") or 1)


def load_per_degree(paths: list[str], **kw) -> tuple[dict[int, CostModel], dict]:
    """{degree: cost model} of several profiles of one checkpoint, one per degree, and the first
    report; ProfileError on two profiles of one degree."""
    out: dict[int, CostModel] = {}
    first = None
    for path in paths:
        costs, report = CostModel.load(path, **kw)
        first = first or report
        d = degree_of(report)
        if d in out:
            raise ProfileError(f"two profiles at tensor_parallel_size {d}: {out[d].source} and {path}")
        out[d] = costs
    if first is None:
        raise ProfileError("no profile given")
    return out, first
