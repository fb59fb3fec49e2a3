"""Reports of `epdserve bench serve`: per-request rows, the Markdown tables, the PNG figures.

Owns the report's presentation only (the numbers come from `metrics`): `request_rows` (the
per-request latencies kept in the JSON, which the CDFs are drawn from, with each request's longest
inter-token gap), `latency_summary` (the one-line TPOT p50/p90/p99 and ITL p99 of a run's log
line), `markdown` (per workload: one row per mode and rate: TTFT p50/p99, TPOT p50/p90/p99 over
requests, ITL p50/p99 over all gaps, goodput, with ratios against the baseline mode, text vs image
TTFT for mixed traffic, the TTFT stage split, the highest rate meeting the p99 SLOs) and `plot`
(per workload, one PNG: TTFT CDF, TPOT CDF, goodput against rate, stage bars; matplotlib Agg). A run
with phases (the shift workload) adds its per-phase table and a timeline PNG (bench/shift.py); a
multi-turn run adds its per-turn tables (bench/multiturn_report.py), and its rows their turn.
"""
from __future__ import annotations

import math
import pathlib

from epdserve.bench.multiturn_report import turn_table
from epdserve.bench.shift import phase_table, plot_timeline
from epdserve.bench.spread import fmt_ratio, goodput_ratio_interval, median_ratio_interval
from epdserve.perf.serving_metrics import POST_STAGES, TTFT_STAGES, RequestRecord, max_rate_meeting_slo, ttft_segments

STAGE_ORDER = ["send", *(n for _, n in TTFT_STAGES), "return"]
POST_ORDER = [n for _, _, n in POST_STAGES]


def request_rows(records: list[RequestRecord]) -> list[dict]:
    def ms(x):
        return None if x is None else round(x * 1e3, 3)

    rows = []
    for r in records:
        rows.append({"id": r.request_id, "kind": r.kind, "images": r.num_images, "ok": r.success, "error": r.error or None,
                     "ttft_ms": ms(r.ttft), "tpot_ms": ms(r.tpot), "itl_max_ms": ms(r.itl_max), "e2el_ms": ms(r.e2el),
                     "output_tokens": r.n_out,
                     "prompt_tokens": r.prompt_tokens, "vision_tokens": r.vision_tokens,
                     "cached_vision_tokens": r.cached_vision_tokens,
                     "stages_ms": {k: round(v * 1e3, 3) for k, v in ttft_segments(r).items()}})
        if r.turn is not None:
            rows[-1]["turn"] = r.turn
        if r.cached_tokens is not None:
            rows[-1]["cached_tokens"] = r.cached_tokens
    return rows


def latency_summary(m: dict) -> str:
    """'TPOT p50/p90/p99 31.0/35.2/61.4 ms, ITL p99 88.0 ms' from a run's metrics."""
    t = m["tpot_ms"]
    return (f"TPOT p50/p90/p99 {_f(t['median'])}/{_f(t['p90'])}/{_f(t['p99'])} ms, "
            f"ITL p99 {_f(m['itl_ms']['p99'])} ms")


def _rate(r) -> str:
    return "inf" if r is None or math.isinf(float(r)) else f"{float(r):g}"


def _f(x, nd=1) -> str:
    return "-" if x is None else f"{x:.{nd}f}"


def _ratio(a, b, nd=2) -> str:
    if a is None or b is None:
        return "-"
    if b == 0:
        return "-" if a == 0 else "inf"
    return f"{a / b:.{nd}f}x"


def _goodput_vs(run: dict, base: dict | None, slo: dict) -> str:
    """Goodput over the baseline's at the same rate, with its 95% bootstrap interval (bench/spread.py)."""
    if base is None:
        return "-"
    if base is run:
        return "base"
    m, bm = run["metrics"], base["metrics"]
    if not bm["goodput"]:
        return _ratio(m["goodput"], bm["goodput"])
    if m["slo_attainment"] == 1.0 and bm["slo_attainment"] == 1.0:  # resampling cannot move it: say why
        return f"{m['goodput'] / bm['goodput']:.2f}x (all met in both)"
    ci = goodput_ratio_interval(run.get("requests") or [], base.get("requests") or [], m["duration_s"],
                                bm["duration_s"], slo)
    return fmt_ratio(m["goodput"] / bm["goodput"], ci)


def _ttft_vs(run: dict, base: dict | None) -> str:
    if base is None:
        return "-"
    if base is run:
        return "base"
    a, b = run["metrics"]["ttft_ms"]["median"], base["metrics"]["ttft_ms"]["median"]
    if a is None or not b:
        return _ratio(a, b)
    ci = median_ratio_interval([r.get("ttft_ms") for r in run.get("requests") or []],
                               [r.get("ttft_ms") for r in base.get("requests") or []])
    return fmt_ratio(a / b, ci)


def _runs(mode_entry: dict) -> list[dict]:
    return mode_entry.get("runs") or []


def _baseline(modes: dict, baseline: str | None) -> str | None:
    if baseline in modes:
        return baseline
    return next(iter(modes), None)


def _same_rate(modes: dict, mode: str, run: dict) -> dict | None:
    for other in _runs(modes.get(mode) or {}):
        if other["rate"] == run["rate"] and other.get("max_concurrency") == run.get("max_concurrency"):
            return other
    return None


def markdown(report: dict, baseline: str | None = "monolithic") -> str:
    out = []
    slo = report.get("slo", {})
    out.append("load = the machine's 1-minute load average when the run started (other work shares the CPU).")
    out.append("vs base: the ratio to the baseline's figure at the same rate, with its 95% interval from resampling "
               "both runs' requests (bootstrap; both runs have the same arrivals); 'within noise' when that interval "
               "contains 1; 'all met in both': every request met both SLOs in both runs (the ratio is one of durations).")
    out.append(f"SLO: TTFT <= {_f(slo.get('ttft_ms'), 0)} ms, TPOT <= {_f(slo.get('tpot_ms'), 0)} ms"
               + (f", E2EL <= {_f(slo.get('e2el_ms'), 0)} ms" if slo.get("e2el_ms") else "")
               + (f" ({report['slo_note']})" if report.get("slo_note") else ""))
    for wname, w in report.get("workloads", {}).items():
        modes = w.get("modes", {})
        base = _baseline(modes, baseline)
        out += ["", f"### {wname}: {w.get('summary', '')}".rstrip(": "), ""]
        out.append("| mode | rate | ok/fail | req/s | out tok/s | total tok/s | goodput req/s | out tok/s under SLO | SLO att. | "
                   "TTFT p50 | TTFT p99 | TPOT p50 | TPOT p90 | TPOT p99 | ITL p50 | ITL p99 | E2EL p50 | goodput vs base | "
                   "TTFT p50 vs base | load |")
        out.append("|---|" + "---:|" * 19)
        for mode, entry in modes.items():
            if entry.get("error") and not _runs(entry):
                out.append(f"| {mode} | - | failed: {entry['error'][:80]} |" + " |" * 17)
                continue
            for run in _runs(entry):
                m = run["metrics"]
                b = _same_rate(modes, base, run) if base else None
                out.append(
                    f"| {mode} | {_rate(run['rate'])} | {m['completed']}/{m['failed']} | {m['request_throughput']:.3f} | "
                    f"{m['output_throughput']:.1f} | {m['total_token_throughput']:.1f} | {m['goodput']:.3f} | "
                    f"{m.get('output_throughput_under_slo', 0.0):.1f} | {100 * m['slo_attainment']:.0f}% | {_f(m['ttft_ms']['median'], 0)} | {_f(m['ttft_ms']['p99'], 0)} | "
                    f"{_f(m['tpot_ms']['median'])} | {_f(m['tpot_ms']['p90'])} | {_f(m['tpot_ms']['p99'])} | "
                    f"{_f(m['itl_ms']['median'])} | {_f(m['itl_ms']['p99'])} | {_f(m['e2el_ms']['median'], 0)} | {_goodput_vs(run, b, slo)} | {_ttft_vs(run, b)} | "
                    f"{_f((run.get('load_avg_1m') or [None])[0])} |")
        out += _kind_table(modes, base)
        out += phase_table(modes)
        out += turn_table(modes)
        out += _stage_table(modes)
        out += _max_rate_lines(modes)
    return "\n".join(out)


def _kind_table(modes: dict, base: str | None) -> list[str]:
    kinds = sorted({k for e in modes.values() for r in _runs(e) for k in r["metrics"].get("by_kind", {})})
    if len(kinds) < 2:
        return []
    head = " | ".join(f"{k} TTFT p50 | {k} TTFT p90 | {k} vs base" for k in kinds)
    lines = ["", f"| mode | rate | {head} |", "|---|---:|" + "---:|" * (3 * len(kinds))]
    for mode, entry in modes.items():
        for run in _runs(entry):
            b = _same_rate(modes, base, run) if base else None
            cells = []
            for k in kinds:
                t = run["metrics"]["by_kind"].get(k, {}).get("ttft_ms", {})
                bt = (b["metrics"].get("by_kind", {}).get(k, {}).get("ttft_ms", {}) if b else {})
                cells.append(f"{_f(t.get('median'), 0)} | {_f(t.get('p90'), 0)} | {_ratio(t.get('median'), bt.get('median'))}")
            lines.append(f"| {mode} | {_rate(run['rate'])} | " + " | ".join(cells) + " |")
    return lines


def _stage_table(modes: dict) -> list[str]:
    present = [s for s in STAGE_ORDER + POST_ORDER
               if any(s in r["metrics"].get("stages_ms", {}) for e in modes.values() for r in _runs(e))]
    if not present:
        return []
    lines = ["", "TTFT split by stage (mean ms over requests; the TTFT stages add up to the mean TTFT; "
                 "P->D and first decode come after the first token):", "",
             "| mode | rate | " + " | ".join(present) + " |", "|---|---:|" + "---:|" * len(present)]
    for mode, entry in modes.items():
        for run in _runs(entry):
            st = run["metrics"].get("stages_ms", {})
            lines.append(f"| {mode} | {_rate(run['rate'])} | "
                         + " | ".join(_f((st.get(s) or {}).get("share_of_mean_ttft", (st.get(s) or {}).get("mean")))
                                      for s in present) + " |")
    return lines


def _max_rate_lines(modes: dict) -> list[str]:
    if not any(len(_runs(e)) > 1 for e in modes.values()):
        return []
    lines = ["", "Highest rate meeting the SLOs at p99 (no failures):", ""]
    for mode, entry in modes.items():
        best = max_rate_meeting_slo([(float(r["rate"]), r["metrics"]) for r in _runs(entry)])
        lines.append(f"- {mode}: {'none of the rates tried' if best is None else f'{best:g} req/s'}")
    return lines


def plot(report: dict, out_dir: str | pathlib.Path, prefix: str = "serve") -> list[pathlib.Path]:
    """One PNG per workload (TTFT CDF, TPOT CDF, goodput vs rate, stage bars); returns the paths."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    out_dir = pathlib.Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    paths = []
    for wname, w in report.get("workloads", {}).items():
        modes = {m: e for m, e in w.get("modes", {}).items() if _runs(e)}
        if not modes:
            continue
        fig, axes = plt.subplots(2, 2, figsize=(13, 9))
        fig.suptitle(f"{wname}: {w.get('summary', '')}", fontsize=10)
        colours = {m: f"C{i}" for i, m in enumerate(modes)}
        slo = report.get("slo", {})
        _cdf(axes[0][0], modes, colours, "ttft_ms", "TTFT (ms)", slo.get("ttft_ms"))
        _cdf(axes[0][1], modes, colours, "tpot_ms", "TPOT (ms)", slo.get("tpot_ms"))
        _goodput(axes[1][0], modes, colours)
        _stages(axes[1][1], modes)
        fig.tight_layout()
        path = out_dir / f"{prefix}-{wname}.png"
        fig.savefig(path, dpi=90)
        plt.close(fig)
        paths.append(path)
        timeline = plot_timeline(wname, w, out_dir / f"{prefix}-{wname}-timeline.png", slo, report.get("events"))
        if timeline is not None:
            paths.append(timeline)
    return paths


def _cdf(ax, modes, colours, key, label, slo_ms=None):
    import numpy as np

    kinds_all = sorted({row["kind"] for e in modes.values() for row in _runs(e)[-1].get("requests", [])})
    styles = {"image": "-", "text": "--"}
    for mode, entry in modes.items():
        run = _runs(entry)[-1]  # the most loaded rate
        for kind in (kinds_all if len(kinds_all) > 1 else [None]):
            vals = np.sort([row[key] for row in run.get("requests", [])
                            if row["ok"] and row[key] is not None and (kind is None or row["kind"] == kind)])
            if vals.size:
                lab = f"{mode}" + (f" ({kind})" if kind else "")
                ax.step(vals, np.arange(1, vals.size + 1) / vals.size, where="post", color=colours[mode],
                        linestyle=styles.get(kind, "-"), label=lab)
    if slo_ms:
        ax.axvline(slo_ms, color="grey", linestyle=":", label="SLO")
    rates = {_rate(_runs(e)[-1]["rate"]) for e in modes.values()}
    ax.set_xlabel(label + f" at rate {'/'.join(sorted(rates))} req/s")
    ax.set_ylabel("fraction of requests")
    ax.set_title(f"{label.split()[0]} CDF per mode")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7)


def _goodput(ax, modes, colours):
    for mode, entry in modes.items():
        pts = sorted((float(r["rate"]), r["metrics"]["goodput"]) for r in _runs(entry) if not math.isinf(float(r["rate"])))
        if pts:
            ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", color=colours[mode], label=mode)
        for r in _runs(entry):
            if math.isinf(float(r["rate"])):
                ax.axhline(r["metrics"]["goodput"], color=colours[mode], linestyle=":", label=f"{mode} (closed loop)")
    ax.set_xlabel("request rate (req/s)")
    ax.set_ylabel("goodput (req/s meeting every SLO)")
    ax.set_title("goodput vs rate")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7)


def _stages(ax, modes):
    names = list(modes)
    bottoms = [0.0] * len(names)
    for i, stage in enumerate(STAGE_ORDER):
        vals = []
        for mode in names:
            st = _runs(modes[mode])[-1]["metrics"].get("stages_ms", {})
            vals.append((st.get(stage) or {}).get("share_of_mean_ttft", 0.0))
        if any(vals):
            ax.bar(names, vals, bottom=bottoms, label=stage, color=f"C{i}")
            bottoms = [b + v for b, v in zip(bottoms, vals)]
    ax.set_ylabel("mean TTFT (ms), split by stage")
    rates = {_rate(_runs(modes[m])[-1]["rate"]) for m in names}
    ax.set_title(f"where TTFT goes at rate {'/'.join(sorted(rates))} req/s (server timestamps)")
    ax.tick_params(axis="x", labelsize=8)
    if any(bottoms):
        ax.legend(fontsize=7)
    else:  # e.g. through the HTTP front, whose responses carry no stage timestamps
        ax.text(0.5, 0.5, "no stage timings reported", ha="center", va="center", transform=ax.transAxes)
