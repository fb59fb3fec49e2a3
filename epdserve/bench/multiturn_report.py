"""The per-turn tables of a multi-turn `bench serve` report (bench/report.py's markdown adds them).

Owns `turn_table(modes)`: per mode and run, TTFT p50 of every turn, of turn 1 and of turns >= 2
together and their ratio (what the prefix cache should shrink), TPOT p50 and SLO attainment of
turns >= 2; and, only when the server reported cached prompt tokens, a second table with the mean
cached tokens per request of every turn and the cached share of turns >= 2's prompt tokens.
`turn_summary` is the run's log line. Reads the `turns` entry of perf/turn_metrics.py.
"""
from __future__ import annotations


def _f(x, nd=0) -> str:
    return "-" if x is None else f"{x:.{nd}f}"


def _runs(modes: dict):
    for mode, entry in modes.items():
        for run in entry.get("runs") or []:
            if run.get("turns"):
                yield mode, run


def _rate(r) -> str:
    return "inf" if r in (None, "inf") or float(r) == float("inf") else f"{float(r):g}"


def turn_table(modes: dict) -> list[str]:
    runs = list(_runs(modes))
    if not runs:
        return []
    n = max(len(run["turns"]["per_turn"]) for _, run in runs)
    lines = ["", "TTFT p50 per turn (ms; turn t is sent after turn t-1's answer plus the think time, with the "
                 "whole history and the images again):", "",
             "| mode | rate | " + " | ".join(f"turn {t}" for t in range(1, n + 1))
             + " | turn 1 | turns >= 2 | >= 2 / 1 | TPOT p50 >= 2 | SLO att. >= 2 |",
             "|---|---:|" + "---:|" * (n + 5)]
    for mode, run in runs:
        tm = run["turns"]
        by_turn = {p["turn"]: p for p in tm["per_turn"]}
        cells = [_f(by_turn.get(t, {}).get("ttft_ms", {}).get("p50")) for t in range(1, n + 1)]
        ratio = tm.get("later_over_first")
        lines.append(f"| {mode} | {_rate(run.get('rate'))} | " + " | ".join(cells)
                     + f" | {_f(tm['first']['ttft_ms']['p50'])} | {_f(tm['later']['ttft_ms']['p50'])} | "
                     f"{'-' if ratio is None else f'{ratio:.2f}x'} | {_f(tm['later']['tpot_ms']['p50'], 1)} | "
                     f"{100 * tm['later']['slo_attainment']:.0f}% |")
    if any("cached_tokens" in p for _, run in runs for p in run["turns"]["per_turn"]):
        lines += ["", "Cached prompt tokens per request (mean; the KV the server reused, from its usage):", "",
                  "| mode | rate | " + " | ".join(f"turn {t}" for t in range(1, n + 1))
                  + " | cached share of prompt, turns >= 2 |", "|---|---:|" + "---:|" * (n + 1)]
        for mode, run in runs:
            by_turn = {p["turn"]: p for p in run["turns"]["per_turn"]}
            share = run["turns"]["later"].get("cached_share")
            lines.append(f"| {mode} | {_rate(run.get('rate'))} | "
                         + " | ".join(_f(by_turn.get(t, {}).get("cached_tokens_mean")) for t in range(1, n + 1))
                         + f" | {'-' if share is None else f'{100 * share:.0f}%'} |")
    return lines


def turn_summary(tm: dict) -> str:
    """'TTFT p50 turn 1 / turns >= 2: 850 / 210 ms (0.25x)' (+ cached share when reported)."""
    ratio = tm.get("later_over_first")
    s = (f"TTFT p50 turn 1 / turns >= 2: {_f(tm['first']['ttft_ms']['p50'])} / {_f(tm['later']['ttft_ms']['p50'])} ms"
         + ("" if ratio is None else f" ({ratio:.2f}x)"))
    share = tm["later"].get("cached_share")
    return s + ("" if share is None else f", cached {100 * share:.0f}% of turns >= 2's prompt tokens")
