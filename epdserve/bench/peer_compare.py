"""The tables of the peer comparison (`benchmarks/vs_transformers_serve.py`): every target's
`bench serve` report merged, then per rate the figures its aims (AIMS) are stated in, and the
ratios against the peer checked against those aims.

Owns `merge_reports` (one report from the targets' reports), `cells` (target -> rate -> the
metrics of its runs in repeat order), `FIGURES` (TTFT p50, TPOT p50/p90/p99 over requests, ITL
p50/p99 over all gaps, SLO goodput, output tok/s), `comparison_table` (each figure the median over repeats, with
min-max when there are several; also the requests in SLO and those that ended before their
max_tokens, and which objective the others missed), `AIMS` (against transformers serve),
`VLLM_AIMS` (against vLLM), `median_spread` (a figure over repeats as the tables print it) and `ratio_rows` / `ratio_table` (target over peer, the
ratio of the medians with the min-max of the per-repeat ratios; repeat k of a target is paired
with repeat k of the peer: the same requests at the same times). An aim `against="reference"`
compares with the monolithic target of an earlier run's merged report (`--reference`: "today's
monolithic"). Pure functions of report dicts; nothing here runs anything.
"""
from __future__ import annotations

import math
import statistics
from dataclasses import dataclass

from epdserve.perf.serving_metrics import SLO

# (column, metrics key, statistic, decimals); key None: a top-level metric
FIGURES = (("TTFT p50 ms", "ttft_ms", "median", 0), ("TPOT p50 ms", "tpot_ms", "median", 1),
           ("TPOT p90 ms", "tpot_ms", "p90", 1), ("TPOT p99 ms", "tpot_ms", "p99", 1),
           ("ITL p50 ms", "itl_ms", "median", 1), ("ITL p99 ms", "itl_ms", "p99", 1),
           ("SLO goodput req/s", None, "goodput", 3),
           ("output tok/s", None, "output_throughput", 0))


@dataclass(frozen=True)
class Aim:
    rate: float
    figure: str  # a column of FIGURES
    op: str  # "<=" or ">="
    bound: float  # on target / other
    against: str = "peer"  # "peer" or "reference" (an earlier run's monolithic)

    def met(self, ratio: float | None) -> bool | None:
        if ratio is None or math.isnan(ratio):
            return None
        return ratio <= self.bound if self.op == "<=" else ratio >= self.bound


AIMS = (Aim(0.5, "TPOT p50 ms", "<=", 1.1), Aim(0.5, "TPOT p99 ms", "<=", 2.0), Aim(0.5, "TTFT p50 ms", "<=", 0.5),
        Aim(1.0, "SLO goodput req/s", ">=", 2.0), Aim(1.0, "SLO goodput req/s", ">=", 1.3, against="reference"))


# against vLLM on the same CPU (issue 50): at 1 req/s TTFT and TPOT p50 at most 0.9x, in a burst
# (rate inf) output tok/s at least 1.2x
VLLM_AIMS = (Aim(1.0, "TTFT p50 ms", "<=", 0.9), Aim(1.0, "TPOT p50 ms", "<=", 0.9),
             Aim(math.inf, "output tok/s", ">=", 1.2))


def merge_reports(reports: list[dict]) -> dict:
    """The first report's header, every report's targets and workloads' modes (later ones win)."""
    if not reports:
        return {"targets": {}, "workloads": {}}
    merged = dict(reports[0])
    merged["targets"], merged["workloads"] = {}, {}
    for r in reports:
        merged["targets"].update(r.get("targets", {}))
        for name, w in r.get("workloads", {}).items():
            entry = merged["workloads"].setdefault(name, {k: v for k, v in w.items() if k != "modes"} | {"modes": {}})
            entry["modes"].update(w.get("modes", {}))
    return merged


def cells(report: dict, workload: str | None = None) -> dict[str, dict[float, list[dict]]]:
    """target -> rate -> [metrics of each run at that rate, in the order they ran]."""
    workloads = report.get("workloads", {})
    name = workload or next(iter(workloads), None)
    out: dict[str, dict[float, list[dict]]] = {}
    for label, entry in (workloads.get(name) or {}).get("modes", {}).items():
        by_rate = out.setdefault(label, {})
        for run in entry.get("runs") or []:
            m = run["metrics"]
            if "slo_missed" not in m and "requests" in run:  # a report from before the count
                m = {**m, "slo_missed": _missed(run["requests"], m.get("slo") or report.get("slo") or {})}
            by_rate.setdefault(float(run["rate"]), []).append(m)
    return out


def _missed(requests: list[dict], slo: dict) -> dict[str, int]:
    """Per objective, the completed requests of a run's records that missed it (`SLO.missed_times`)."""
    objectives = SLO.from_dict(slo)
    missed = [objectives.missed_times(*(None if r.get(k) is None else r[k] / 1e3 for k in ("ttft_ms", "tpot_ms", "e2el_ms")))
              for r in requests if r.get("ok")]
    return {k: sum(k in m for m in missed) for k in ("ttft", "tpot", "e2el")}


def figure_of(m: dict, column: str) -> float | None:
    for col, key, stat, _ in FIGURES:
        if col == column:
            return m.get(stat) if key is None else (m.get(key) or {}).get(stat)
    raise KeyError(column)


def _values(runs: list[dict], column: str) -> list[float]:
    return [v for v in (figure_of(m, column) for m in runs) if v is not None]


def median_spread(values: list[float], nd: int) -> str:
    """'1,234.5 (1,100.0-1,300.0)': the median of `values` with their range, `nd` decimals ('-' when empty)."""
    if not values:
        return "-"
    mid = f"{statistics.median(values):,.{nd}f}"
    return mid if min(values) == max(values) else f"{mid} ({min(values):,.{nd}f}-{max(values):,.{nd}f})"


def _rate_of(by_rate: dict[float, list[dict]], rate: float) -> list[dict]:
    return next((runs for r, runs in by_rate.items() if math.isclose(r, rate)), [])


def comparison_table(report: dict, peer: str, workload: str | None = None) -> str:
    """Markdown: one row per rate and target (the peer first), each figure median (min-max) over repeats."""
    c = cells(report, workload)
    order = ([peer] if peer in c else []) + [t for t in c if t != peer]
    rates = sorted({r for by_rate in c.values() for r in by_rate})
    head = " | ".join(col for col, *_ in FIGURES)
    lines = [f"| rate | server | runs | {head} | in SLO | missed TTFT / TPOT | ended early |",
             "|---:|---|---:|" + "---:|" * (len(FIGURES) + 3)]
    for rate in rates:
        for label in order:
            runs = _rate_of(c[label], rate)
            if not runs:
                continue
            figs = " | ".join(median_spread(_values(runs, col), nd) for col, _, _, nd in FIGURES)
            good = [m.get("good_requests", 0) for m in runs]
            total = max((m.get("num_requests", 0) for m in runs), default=0)
            spread = f" ({min(good)}-{max(good)})" if min(good) != max(good) else ""
            in_slo = f"{statistics.median(good):g}/{total}{spread}"
            missed = " / ".join(median_spread([(m.get("slo_missed") or {}).get(k, 0) for m in runs], 0) for k in ("ttft", "tpot"))
            early = median_spread([m.get("incomplete_outputs", 0) for m in runs], 0)  # fewer tokens than asked (EOS)
            lines.append(f"| {rate:g}/s | {label} | {len(runs)} | {figs} | {in_slo} | {missed} | {early} |")
    return "\n".join(lines)


def _ratio(a: float | None, b: float | None) -> float | None:
    if a is None or b is None:
        return None
    if b == 0:
        return math.nan if a == 0 else math.inf
    return a / b


def ratio_rows(report: dict, peer: str, reference: dict | None = None, aims=AIMS,
               workload: str | None = None, reference_label: str | None = None) -> list[dict]:
    """One row per epdserve target and aim: the ratio of medians, the per-repeat ratios' min and max, met."""
    c = cells(report, workload)
    ref_cells = cells(reference, workload) if reference else {}
    ref_label = reference_label or next((t for t in ref_cells if t.endswith("monolithic")), None)
    rows = []
    for label in (t for t in c if t != peer):
        for aim in aims:
            if aim.against != "peer" and reference is report and label == ref_label:
                continue  # this run's own 'today' target against itself
            other = c.get(peer, {}) if aim.against == "peer" else ref_cells.get(ref_label, {}) if ref_label else {}
            mine, theirs = _values(_rate_of(c[label], aim.rate), aim.figure), _values(_rate_of(other, aim.rate), aim.figure)
            if not mine or not theirs:
                continue
            ratio = _ratio(statistics.median(mine), statistics.median(theirs))
            paired = [x for x in (_ratio(a, b) for a, b in zip(mine, theirs)) if x is not None and not math.isnan(x)]
            rows.append({"target": label, "rate": aim.rate, "figure": aim.figure,
                         "against": peer if aim.against == "peer" else f"reference {ref_label}",
                         "ratio": ratio, "min": min(paired, default=None), "max": max(paired, default=None),
                         "runs": min(len(mine), len(theirs)), "aim": f"{aim.op} {aim.bound:g}x", "met": aim.met(ratio)})
    return rows


def _x(v: float | None) -> str:
    if v is None or math.isnan(v):
        return "-"
    return "inf" if math.isinf(v) else f"{v:.2f}x"


def ratio_table(rows: list[dict]) -> str:
    if not rows:
        return "(no ratio: the peer or every epdserve target is missing from this run)"
    lines = ["| rate | server | figure | against | ratio | per-repeat min-max | aim | met |",
             "|---:|---|---|---|---:|---|---|---|"]
    for r in rows:
        spread = f"{_x(r['min'])}-{_x(r['max'])}" if r["runs"] > 1 else "-"
        met = {True: "yes", False: "**no**", None: "-"}[r["met"]]
        lines.append(f"| {r['rate']:g}/s | {r['target']} | {r['figure']} | {r['against']} | {_x(r['ratio'])} | "
                     f"{spread} | {r['aim']} | {met} |")
    return "\n".join(lines)
