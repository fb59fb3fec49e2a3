"""`epdserve plan --validate RESULTS.json`: predicted against measured goodput, cell by cell.

For every workload, mode and run of a `bench serve` results file, the planner simulates the
same deployment (the instances its ready line lists) on the same requests and arrival schedule
(`shapes.shapes_from_run`) and reports predicted and measured goodput and their relative error
(predicted / measured - 1; None where the measured goodput is 0). The measured figures are read
only to be compared: the prediction uses the profile and the run's request shapes alone.
"""
from __future__ import annotations

import re
from dataclasses import dataclass

from epdserve.perf.serving_metrics import SLO
from epdserve.instance.modes import MODES
from epdserve.planner.costs import CostModel
from epdserve.planner.deployment import from_pools, parse_summary
from epdserve.planner.rank import predict
from epdserve.planner.shapes import WorkloadError, load_results, shapes_from_run
from epdserve.planner.workers import Limits


@dataclass(frozen=True)
class Cell:
    workload: str
    mode: str
    rate: float
    instances: str
    predicted: float
    measured: float
    predicted_ttft_p50_ms: float | None
    measured_ttft_p50_ms: float | None

    @property
    def error(self) -> float | None:
        return None if self.measured <= 0 else self.predicted / self.measured - 1.0


def _instances(target: dict | None) -> str | None:
    m = re.search(r"instances=(\S+)", (target or {}).get("ready_line") or "")
    return m.group(1) if m else None


def _slo(data: dict, slo: SLO | None) -> SLO:
    if slo is not None:
        return slo
    s = data.get("slo") or {}
    return SLO(**{k: s[k] for k in ("ttft_ms", "tpot_ms", "e2el_ms") if s.get(k) is not None})


def validate(path: str, costs: CostModel, colocated_host: bool, slo: SLO | None = None,
             limits: Limits | None = None) -> tuple[list[Cell], list[str]]:
    """(every cell predicted and measured, the targets skipped and why): a target that is not an
    epdserve mode launched by `bench serve` (another server, no ready line) cannot be simulated."""
    data = load_results(path)
    slo = _slo(data, slo)
    cells, skipped = [], []
    for wname, entry in data["workloads"].items():
        for mode, mentry in entry.get("modes", {}).items():
            summary = _instances(data.get("targets", {}).get(mode))
            if mode not in MODES or summary is None:
                skipped.append(f"{wname}/{mode}: " + ("not an epdserve mode" if mode not in MODES
                                                      else "no ready line says which instances ran"))
                continue
            dep = from_pools(mode, parse_summary(summary), colocated_host=colocated_host)
            for run in mentry.get("runs", []):
                pred = predict(dep, costs, shapes_from_run(run), slo, limits)
                meas = run.get("metrics") or {}
                cells.append(Cell(wname, mode, float(run.get("rate") or float("inf")), summary, pred.goodput,
                                  float(meas.get("goodput") or 0.0), pred.metrics["ttft_ms"]["median"],
                                  (meas.get("ttft_ms") or {}).get("median")))
    if not cells:
        raise WorkloadError(f"{path}: no runs to validate against" + (f" ({'; '.join(skipped)})" if skipped else ""))
    return cells, skipped


def table(cells: list[Cell], skipped: list[str] = ()) -> str:
    lines = ["| workload | mode | rate | instances | goodput predicted | goodput measured | error | "
             "TTFT p50 predicted | TTFT p50 measured |", "|---|---|---:|---|---:|---:|---:|---:|---:|"]
    for c in cells:
        err = "-" if c.error is None else f"{100 * c.error:+.0f}%"
        lines.append(f"| {c.workload} | {c.mode} | {c.rate:g} | {c.instances} | {c.predicted:.3f} | {c.measured:.3f} | "
                     f"{err} | {c.predicted_ttft_p50_ms or 0:.0f} | {c.measured_ttft_p50_ms or 0:.0f} |")
    errs = [abs(c.error) for c in cells if c.error is not None]
    if errs:
        lines += ["", f"mean |error| {100 * sum(errs) / len(errs):.0f}% over {len(errs)} cell(s), "
                      f"max {100 * max(errs):.0f}%"]
    lines += [f"skipped {s}" for s in skipped]
    return "\n".join(lines)
