"""`SLO`: the per-request latency objectives (TTFT, TPOT, optionally E2EL), declared once.

Its fields are the `--slo-ttft-ms` / `--slo-tpot-ms` / `--slo-e2el-ms` flags of every command
that counts against an objective (epdserve/settings.py makes them): `bench serve` and the
benchmarks that drive it (goodput, SLO attainment), `epdserve plan` (the predicted goodput),
the scheduler's role controller (attainment pressure), and the engine, whose step budget keeps
each decoding request to 0.9x the TPOT objective (engine/step_budget.py; `EngineConfig.slo_tpot_ms`
is this field, `same_as`). `epdserve launch --slo-tpot-ms` reaches the engines, the controller and
the planner alike. None: that objective is not checked.

`met` / `missed` take anything with a request record's `success`, `ttft`, `tpot`, `e2el`
(seconds; perf.serving_metrics.RequestRecord).
"""
from __future__ import annotations

from dataclasses import dataclass

from epdserve.settings import check_settings, setting


@dataclass(frozen=True)
class SLO:
    ttft_ms: float | None = setting(
        3000.0, flag="--slo-ttft-ms", check=(">", 0), metavar="MS",
        help="TTFT objective, ms: a request meets it when its first token comes within this of its send")
    tpot_ms: float | None = setting(
        100.0, flag="--slo-tpot-ms", check=(">", 0), metavar="MS",
        help="TPOT objective, ms per output token after the first; the engines' step budget keeps each decoding "
             "request to 0.9x it (engine/step_budget.py)")
    e2el_ms: float | None = setting(None, flag="--slo-e2el-ms", check=(">", 0), metavar="MS",
                                    help="end-to-end latency objective, ms (default: none)")

    def __post_init__(self):
        check_settings(self)

    @property
    def ttft_s(self) -> float | None:
        return None if self.ttft_ms is None else self.ttft_ms / 1e3

    @property
    def tpot_s(self) -> float | None:
        return None if self.tpot_ms is None else self.tpot_ms / 1e3

    @property
    def e2el_s(self) -> float | None:
        return None if self.e2el_ms is None else self.e2el_ms / 1e3

    def met(self, r) -> bool:
        return r.success and not self.missed(r)

    def missed(self, r) -> list[str]:
        """The objectives a completed request missed ("ttft", "tpot", "e2el")."""
        return self.missed_times(r.ttft, r.tpot, r.e2el)

    def missed_times(self, ttft: float | None, tpot: float | None, e2el: float | None) -> list[str]:
        """The objectives these latencies (seconds) miss; no TTFT misses, no TPOT (N_out <= 1) counts as 0."""
        out = []
        if self.ttft_s is not None and (ttft is None or ttft > self.ttft_s):
            out.append("ttft")
        if self.tpot_s is not None and (tpot or 0.0) > self.tpot_s:
            out.append("tpot")
        if self.e2el_s is not None and e2el is not None and e2el > self.e2el_s:
            out.append("e2el")
        return out

    def to_dict(self) -> dict:
        return {"ttft_ms": self.ttft_ms, "tpot_ms": self.tpot_ms, "e2el_ms": self.e2el_ms}

    @classmethod
    def from_dict(cls, d: dict) -> "SLO":
        """The inverse of `to_dict` (a report's "slo"); an objective it lacks is not checked."""
        return cls(**{k: d.get(k) for k in ("ttft_ms", "tpot_ms", "e2el_ms")})


SLO_FLAGS = ("ttft_ms", "tpot_ms")  # the pair every command offers; bench serve adds e2el_ms
