"""Every candidate deployment simulated on one workload, scored and ranked.

`Prediction` is one deployment's figures, computed by `perf.serving_metrics.compute_metrics` from
the simulated records (so goodput, "output tok/s under the SLO" and the percentiles mean exactly
what `epdserve bench serve` reports). `rank` orders by goodput, then output tok/s under the SLO, then
TTFT p90 (lower first), then fewer instances. `table` is the markdown ranking.
"""
from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from epdserve.perf.serving_metrics import SLO, compute_metrics
from epdserve.instance.modes import MODES
from epdserve.planner.costs import CostModel
from epdserve.planner.deployment import PlannedDeployment, StageDegrees, splits
from epdserve.planner.shapes import RequestShape
from epdserve.planner.simulate import simulate
from epdserve.planner.workers import Limits

DEFAULT_SLO = SLO()  # the defaults every command shares (epdserve/slo.py)


@dataclass(frozen=True)
class Prediction:
    deployment: PlannedDeployment
    metrics: dict

    @property
    def goodput(self) -> float:
        return self.metrics["goodput"]

    def sort_key(self) -> tuple:
        m = self.metrics
        return (-m["good_requests"], m["ttft_ms"]["p90"] or 0.0, self.deployment.num_instances, -m["goodput"])

    def row(self) -> dict:
        m, d = self.metrics, self.deployment
        return {"mode": d.mode, "split": d.split, "instances": d.summary, "goodput": m["goodput"],
                "slo_attainment": m["slo_attainment"], "output_throughput_under_slo": m["output_throughput_under_slo"],
                "ttft_p50_ms": m["ttft_ms"]["median"], "ttft_p90_ms": m["ttft_ms"]["p90"],
                "tpot_p50_ms": m["tpot_ms"]["median"], "tpot_p90_ms": m["tpot_ms"]["p90"]}


def predict(deployment: PlannedDeployment, costs: CostModel | Mapping[int, CostModel], shapes: list[RequestShape], slo: SLO = DEFAULT_SLO,
            limits: Limits | None = None) -> Prediction:
    records = simulate(deployment, costs, shapes, tpot_pace_s=slo.tpot_s or 0.0, limits=limits)
    return Prediction(deployment, compute_metrics(records, slo, by_kind=False))


def rank(costs: CostModel | Mapping[int, CostModel], shapes: list[RequestShape], devices: int,
         colocated_host: bool = False, modes: tuple[str, ...] = MODES, slo: SLO = DEFAULT_SLO,
         limits: Limits | None = None, degrees: StageDegrees = StageDegrees()) -> list[Prediction]:
    """Every split of every mode that fits `devices` at `degrees` (devices counted per instance),
    best first; `costs` one model, or one per degree (`simulate.Simulation`)."""
    preds = [predict(d, costs, shapes, slo, limits) for mode in modes
             for d in splits(mode, devices, colocated_host, degrees)]
    return sorted(preds, key=Prediction.sort_key)


def _f(x, nd=1) -> str:
    return "-" if x is None else f"{x:.{nd}f}"


def table(preds: list[Prediction], top: int | None = None) -> str:
    lines = ["| # | mode | E:P:D | instances | goodput req/s | SLO att. | out tok/s under SLO | TTFT p50 | TTFT p90 "
             "| TPOT p50 | TPOT p90 |", "|---:|---|---|---|---:|---:|---:|---:|---:|---:|---:|"]
    for i, p in enumerate(preds[:top] if top else preds, 1):
        r = p.row()
        lines.append(f"| {i} | {r['mode']} | {r['split']} | {r['instances']} | {r['goodput']:.3f} | "
                     f"{100 * r['slo_attainment']:.0f}% | {r['output_throughput_under_slo']:.1f} | "
                     f"{_f(r['ttft_p50_ms'], 0)} | {_f(r['ttft_p90_ms'], 0)} | {_f(r['tpot_p50_ms'])} | "
                     f"{_f(r['tpot_p90_ms'])} |")
    return "\n".join(lines)
