"""The `shift` workload of `epdserve bench serve`: traffic whose shape changes mid-run.

Owns `ShiftConfig` (the phases: presets in order, default image-heavy → text-heavy → mixed, the
run's requests split evenly between them; an optional per-phase factor on the request rate),
`build_shift` (the requests, their send offsets and the `Phase`s with their boundaries),
`phase_metrics` (each phase's serving figures), `annotate_rows` (send time and phase of every
request row), `phase_table` (the report's Markdown) and `plot_timeline` (TTFT, TPOT and per-phase
goodput on a time axis, with the phase boundaries and any recorded events, e.g. role switches).

Arrivals are one continuous gamma process over the whole run (shape = burstiness): the gap
before a request is drawn at the run's rate and divided by its phase's rate factor, so with the
default factors of 1 the offsets are exactly `perf.arrivals.arrival_times(n, rate, burstiness, seed)`.
A phase starts at its first request's scheduled send offset and ends where the next one starts;
the last one ends one mean gap after its last request. Per-phase goodput is the phase's requests
that met every SLO per second of that window (its arrival window, so a phase whose requests
finish during the next one still counts them as its own).
"""
from __future__ import annotations

import math
import pathlib
from dataclasses import dataclass, field, replace

import numpy as np

from epdserve.perf.arrivals import arrival_times
from epdserve.perf.presets import PRESETS
from epdserve.perf.serving_metrics import SLO, RequestRecord, compute_metrics
from epdserve.perf.workload import BenchRequest, WorkloadConfig, build_workload

SHIFT = "shift"
DEFAULT_PHASES = ("image-heavy", "text-heavy", "mixed")
DEFAULT_REQUESTS = 36


@dataclass(frozen=True)
class ShiftConfig:
    """`phases`: one preset-shaped `WorkloadConfig` per phase, in order (each with its share of
    the requests); `rate_factors`: per phase, a factor on the run's request rate (empty: 1 each)."""

    phases: tuple[WorkloadConfig, ...]
    rate_factors: tuple[float, ...] = ()
    seed: int = 0
    name: str = SHIFT

    def __post_init__(self):
        if not self.phases:
            raise ValueError("a shift workload needs at least one phase")
        if self.rate_factors and (len(self.rate_factors) != len(self.phases) or min(self.rate_factors) <= 0):
            raise ValueError("rate_factors: one positive factor per phase")

    @property
    def num_requests(self) -> int:
        return sum(p.num_requests for p in self.phases)

    @property
    def factors(self) -> tuple[float, ...]:
        return self.rate_factors or (1.0,) * len(self.phases)

    def with_(self, **changes) -> ShiftConfig:
        """seed=: every phase takes it too (their names keep their images apart)."""
        if "seed" in changes:
            changes["phases"] = tuple(p.with_(seed=changes["seed"]) for p in changes.get("phases", self.phases))
        return replace(self, **changes)

    def to_dict(self) -> dict:
        return {"name": self.name, "seed": self.seed, "rate_factors": list(self.factors),
                "phases": [p.to_dict() for p in self.phases]}

    def summary(self) -> str:
        parts = [f"{_preset(p)} ({p.num_requests} req" + (f", rate x{f:g}" if f != 1 else "") + ")"
                 for p, f in zip(self.phases, self.factors)]
        return f"{self.num_requests} requests in phases " + " -> ".join(parts) + ", arrivals continuous"


def shift_config(changes: dict | None = None, phases: tuple[str, ...] = DEFAULT_PHASES,
                 rate_factors: tuple[float, ...] = ()) -> ShiftConfig:
    """The phases from the named presets, `changes` (WorkloadConfig knobs, as `bench serve`'s
    flags give them) applied to each; `num_requests` is the whole run's, split evenly (the first
    phases take the remainder)."""
    changes = dict(changes or {})
    total = int(changes.pop("num_requests", DEFAULT_REQUESTS))
    seed = int(changes.pop("seed", 0))
    unknown = [p for p in phases if p not in PRESETS]
    if unknown:
        raise ValueError(f"unknown phase preset(s) {', '.join(unknown)}; presets: {', '.join(PRESETS)}")
    if total < len(phases):
        raise ValueError(f"a shift run needs at least one request per phase ({len(phases)}), got {total}")
    counts = [total // len(phases) + (1 if i < total % len(phases) else 0) for i in range(len(phases))]
    cfgs = tuple(PRESETS[p].with_(**changes, name=f"{SHIFT}{i}-{p}", num_requests=n, seed=seed)
                 for i, (p, n) in enumerate(zip(phases, counts)))
    return ShiftConfig(cfgs, tuple(rate_factors), seed)


def _preset(cfg: WorkloadConfig) -> str:
    return cfg.name.split("-", 1)[1] if cfg.name.startswith(SHIFT) and "-" in cfg.name else cfg.name


@dataclass(frozen=True)
class Phase:
    index: int
    name: str  # the preset
    first: int  # index of its first request in the run
    count: int
    rate: float  # its request rate (req/s)
    start_s: float  # scheduled send offset of its first request
    end_s: float  # the next phase's start; the last phase: one mean gap after its last request

    def to_dict(self) -> dict:
        return {"index": self.index, "name": self.name, "first": self.first, "count": self.count,
                "rate": self.rate, "start_s": round(self.start_s, 3), "end_s": round(self.end_s, 3)}


@dataclass
class ShiftRun:
    requests: list[BenchRequest]
    offsets: list[float]  # scheduled send offset of each request (s from the start)
    phases: list[Phase] = field(default_factory=list)


def build_shift(cfg: ShiftConfig, rate: float, burstiness: float = 1.0) -> ShiftRun:
    """The run's requests in send order, their offsets and the phases (seeded by cfg.seed)."""
    requests, phase_of = [], []
    for i, p in enumerate(cfg.phases):
        reqs = build_workload(p)
        requests += reqs
        phase_of += [i] * len(reqs)
    n = len(requests)
    offsets = arrival_times(n, rate, burstiness, cfg.seed)  # validates rate and burstiness
    if not math.isinf(rate) and any(f != 1.0 for f in cfg.factors):  # a phase's gaps shrink by its factor
        gaps = np.diff(offsets) / np.asarray([cfg.factors[phase_of[j]] for j in range(1, n)], dtype=float)
        offsets = [0.0, *np.cumsum(gaps).tolist()]
    phases, first = [], 0
    for i, p in enumerate(cfg.phases):
        prate = rate * cfg.factors[i]
        nxt = first + p.num_requests
        end = offsets[nxt] if nxt < n else offsets[-1] + (0.0 if math.isinf(prate) else 1.0 / prate)
        phases.append(Phase(i, _preset(p), first, p.num_requests, prate, offsets[first], end))
        first = nxt
    return ShiftRun(requests, offsets, phases)


def phase_metrics(run: ShiftRun, records: list[RequestRecord], slo: SLO) -> list[dict]:
    """Per phase: its window, request count and the serving metrics of its requests (compute_metrics,
    with goodput over the phase's window)."""
    by_id = {r.request_id: r for r in records}
    out = []
    for ph in run.phases:
        recs = [by_id[q.request_id] for q in run.requests[ph.first:ph.first + ph.count] if q.request_id in by_id]
        m = compute_metrics(recs, slo, by_kind=False)
        window = ph.end_s - ph.start_s
        keep = {k: m[k] for k in ("num_requests", "completed", "failed", "good_requests", "slo_attainment",
                                  "output_throughput_under_slo", "duration_s")}
        keep["goodput"] = m["good_requests"] / window if window > 0 else m["goodput"]
        for k in ("ttft_ms", "tpot_ms", "e2el_ms"):
            keep[k] = {q: m[k][q] for q in ("median", "p90", "p99")}
        out.append({**ph.to_dict(), "window_s": window, "metrics": keep})
    return out


def annotate_rows(rows: list[dict], records: list[RequestRecord], run: ShiftRun, slo: SLO) -> dict:
    """Add to each request row (request_rows' order = records') its send time `t_s` (s from the run's
    first request), its phase and whether it met every SLO; returns the run's time origin."""
    phase = {q.request_id: ph.index for ph in run.phases for q in run.requests[ph.first:ph.first + ph.count]}
    t0 = min((r.t0 for r in records), default=0.0)
    for row, r in zip(rows, records):
        row.update(t_s=round(r.t0 - t0, 4), phase=phase.get(r.request_id), slo_met=slo.met(r))
    return {"start_wall": min((r.t0_wall for r in records), default=0.0)}


def events_of(run: dict, report_events=()) -> list[tuple[float, str]]:
    """(s from the run's start, label) of the events recorded for a run (e.g. role switches): the
    run's own `events` and the report's `events`, each {"t_s": s from the run start, "label": ...},
    {"time": Unix s, "label": ...} (placed with the run's `start_wall`; outside the run: left out)
    or a [t_s, label] pair."""
    span = max([row.get("t_s") or 0.0 for row in run.get("requests") or []] + [run.get("wall_s") or 0.0])
    out = []
    for ev in [*(run.get("events") or []), *(report_events or [])]:
        if isinstance(ev, (list, tuple)) and len(ev) == 2:
            t, label = float(ev[0]), str(ev[1])
        elif isinstance(ev, dict) and "t_s" in ev:
            t, label = float(ev["t_s"]), str(ev.get("label", ""))
        elif isinstance(ev, dict) and "time" in ev and run.get("start_wall"):
            t, label = float(ev["time"]) - float(run["start_wall"]), str(ev.get("label", ""))
        else:
            continue
        if 0.0 <= t <= span:
            out.append((t, label))
    return sorted(out)


def phase_table(modes: dict) -> list[str]:
    """Markdown lines: one row per mode, rate and phase, then the whole run (empty without phases)."""
    runs = [(mode, run) for mode, e in modes.items() for run in e.get("runs") or [] if run.get("phases")]
    if not runs:
        return []
    lines = ["", "Per phase (goodput: the phase's requests meeting every SLO per second of its arrival window; "
                 "all: the whole run as above):", "",
             "| mode | rate | phase | window s | ok/fail | goodput req/s | SLO att. | TTFT p50 | TTFT p99 | TPOT p50 | "
             "TPOT p99 |", "|---|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for mode, run in runs:
        rate = "inf" if math.isinf(float(run["rate"])) else f"{float(run['rate']):g}"
        cells = [(f"{p['index'] + 1}. {p['name']}", f"{p['start_s']:.1f}-{p['end_s']:.1f}", p["metrics"])
                 for p in run["phases"]] + [("all", "-", run["metrics"])]
        for name, window, m in cells:
            lines.append(f"| {mode} | {rate} | {name} | {window} | {m['completed']}/{m['failed']} | "
                         f"{m['goodput']:.3f} | {100 * m['slo_attainment']:.0f}% | {_f(m['ttft_ms']['median'], 0)} | "
                         f"{_f(m['ttft_ms']['p99'], 0)} | {_f(m['tpot_ms']['median'])} | {_f(m['tpot_ms']['p99'])} |")
    return lines


def _f(x, nd=1) -> str:
    return "-" if x is None else f"{x:.{nd}f}"


def plot_timeline(wname: str, w: dict, path: str | pathlib.Path, slo: dict | None = None,
                  report_events=()) -> pathlib.Path | None:
    """One PNG: TTFT and TPOT of every request against its send time, and each phase's goodput as
    a step, per mode (each mode's last run with phases); phase boundaries as dashed lines, events
    (`events_of`) as vertical lines in the mode's colour. None when no run has phases."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    runs = {m: [r for r in e.get("runs") or [] if r.get("phases")] for m, e in w.get("modes", {}).items()}
    runs = {m: rs[-1] for m, rs in runs.items() if rs}
    if not runs:
        return None
    slo = slo or {}
    fig, axes = plt.subplots(3, 1, figsize=(13, 10), sharex=True)
    rates = sorted({"inf" if math.isinf(float(r["rate"])) else f"{float(r['rate']):g}" for r in runs.values()})
    fig.suptitle(f"{wname}: {w.get('summary', '')} at {'/'.join(rates)} req/s", fontsize=10)
    for i, (mode, run) in enumerate(runs.items()):
        colour = f"C{i}"
        rows = [row for row in run.get("requests") or [] if row.get("t_s") is not None]
        for ax, key in ((axes[0], "ttft_ms"), (axes[1], "tpot_ms")):
            ok = [(row["t_s"], row[key]) for row in rows if row["ok"] and row.get(key) is not None]
            if ok:
                ax.scatter(*zip(*ok), s=12, color=colour, label=mode)
            bad = [row["t_s"] for row in rows if not row["ok"]]
            if bad:
                ax.scatter(bad, [ax.get_ylim()[1]] * len(bad), marker="x", color=colour, label=f"{mode} failed")
        xs, ys = [], []
        for p in run["phases"]:
            xs += [p["start_s"], p["end_s"]]
            ys += [p["metrics"]["goodput"]] * 2
        axes[2].plot(xs, ys, color=colour, label=mode)
        for t, label in events_of(run, report_events):
            for ax in axes:
                ax.axvline(t, color=colour, linestyle="-", alpha=0.6, linewidth=1)
            axes[0].annotate(f"{mode}: {label}", (t, 0.97), xycoords=("data", "axes fraction"), rotation=90,
                             fontsize=6, va="top", ha="right", color=colour)
    phases = next(iter(runs.values()))["phases"]
    for p in phases:
        for ax in axes:
            if p["index"]:
                ax.axvline(p["start_s"], color="grey", linestyle="--", linewidth=1)
        axes[0].annotate(p["name"], (p["start_s"], 1.02), xycoords=("data", "axes fraction"), fontsize=8)
    for ax, key, label in ((axes[0], "ttft_ms", "TTFT (ms)"), (axes[1], "tpot_ms", "TPOT (ms)")):
        if slo.get(key):
            ax.axhline(slo[key], color="grey", linestyle=":", label="SLO")
        ax.set_ylabel(label)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7, loc="upper right")
    axes[2].set_ylabel("goodput per phase (req/s)")
    axes[2].set_xlabel("send time (s from the run's first request); dashed: phase boundaries")
    axes[2].grid(alpha=0.3)
    axes[2].legend(fontsize=7, loc="upper right")
    fig.tight_layout()
    path = pathlib.Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=90)
    plt.close(fig)
    return path
