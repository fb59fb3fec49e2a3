"""The tables of the multi-turn benchmark (`benchmarks/multiturn.py`): each target's figures over
its repeats, and each pair's on/off ratios against its aims.

Owns `Pair` and `PAIRS` (the prefix cache on / off in monolithic and in P-D; with 2 P instances,
cache-aware / least-load routing), `figures` (one run's turn 1 and turns >= 2 TTFT p50, TPOT p50,
SLO goodput, cached share of turns >= 2's prompt tokens), `target_table` (per target, each figure
the median over repeats with min-max), `pair_rows` / `pair_table` (per pair, on over off: the
ratio of the medians with the min-max of the per-repeat ratios, repeat k paired with repeat k, which
had the same conversations at the same times; whether the aim is met), and for the routing pair
the cached share against one P instance's (the hit rate an ideal router would reach). Pure
functions of a `bench serve` report dict.
"""
from __future__ import annotations

import statistics
from dataclasses import dataclass

# (column, key of figures(), decimals)
COLUMNS = (("turn 1 TTFT p50 ms", "ttft_first", 0), ("turns >= 2 TTFT p50 ms", "ttft_later", 0),
           ("TPOT p50 ms", "tpot", 1), ("SLO goodput req/s", "goodput", 3), ("cached share >= 2", "cached_share", 2))


@dataclass(frozen=True)
class Pair:
    name: str
    on: str  # target label (a bench serve mode or MODE#NAME variant)
    off: str
    what: str  # "prefix cache on / off", ...
    ttft_aim: float | None = None  # turns >= 2 TTFT p50 on/off must be <= this
    goodput_aim: float | None = None  # SLO goodput on/off must be >= this
    ideal: str | None = None  # a target whose cached share is the ideal of `on`'s (one P instance)
    hit_aim: float | None = None  # on's cached share / ideal's must be >= this


PAIRS = (Pair("monolithic", "monolithic", "monolithic#no-cache", "prefix cache on / off", ttft_aim=0.3),
         Pair("P-D", "P-D", "P-D#no-cache", "prefix cache on / off", ttft_aim=0.3),
         Pair("2 P routing", "P-D#2P", "P-D#2P-least-load", "cache-aware / least-load routing", goodput_aim=1.3,
              ideal="P-D", hit_aim=0.9))


def figures(run: dict) -> dict:
    tm, m = run.get("turns") or {}, run.get("metrics") or {}
    first, later = tm.get("first") or {}, tm.get("later") or {}
    return {"ttft_first": (first.get("ttft_ms") or {}).get("p50"), "ttft_later": (later.get("ttft_ms") or {}).get("p50"),
            "tpot": (m.get("tpot_ms") or {}).get("p50"), "goodput": m.get("goodput"),
            "cached_share": later.get("cached_share")}


def runs_of(report: dict, target: str) -> list[dict]:
    """The target's runs of the (first) multi-turn workload, in the order they ran."""
    for w in report.get("workloads", {}).values():
        if target in w.get("modes", {}):
            return w["modes"][target].get("runs") or []
    return []


def _spread(values: list[float], nd: int) -> str:
    vals = [v for v in values if v is not None]
    if not vals:
        return "-"
    med = f"{statistics.median(vals):.{nd}f}"
    return med if len(vals) == 1 else f"{med} ({min(vals):.{nd}f}-{max(vals):.{nd}f})"


def target_table(report: dict, targets: list[str]) -> str:
    lines = ["| target | runs | " + " | ".join(c for c, _, _ in COLUMNS) + " |", "|---|---:|" + "---:|" * len(COLUMNS)]
    for t in targets:
        runs = runs_of(report, t)
        figs = [figures(r) for r in runs]
        lines.append(f"| {t} | {len(runs)} | " + " | ".join(_spread([f[k] for f in figs], nd) for _, k, nd in COLUMNS)
                     + " |")
    return "\n".join(lines)


def _ratio(on: list[dict], off: list[dict], key: str) -> dict:
    """Median(on) / median(off), and the per-repeat ratios (repeat k against repeat k)."""
    a = [f[key] for f in on if f[key] is not None]
    b = [f[key] for f in off if f[key] is not None]
    per = [x[key] / y[key] for x, y in zip(on, off) if x[key] is not None and y[key]]
    ratio = statistics.median(a) / statistics.median(b) if a and b and statistics.median(b) else None
    return {"ratio": ratio, "per_repeat": per}


def pair_rows(report: dict, pairs: tuple[Pair, ...] = PAIRS) -> list[dict]:
    rows = []
    for p in pairs:
        on, off = [figures(r) for r in runs_of(report, p.on)], [figures(r) for r in runs_of(report, p.off)]
        if not on and not off:
            continue
        ttft, good = _ratio(on, off, "ttft_later"), _ratio(on, off, "goodput")
        row = {"pair": p.name, "what": p.what, "on": p.on, "off": p.off, "repeats": min(len(on), len(off)),
               "ttft_later": ttft, "goodput": good,
               "ttft_aim": p.ttft_aim, "ttft_met": _met(ttft["ratio"], p.ttft_aim, "<="),
               "goodput_aim": p.goodput_aim, "goodput_met": _met(good["ratio"], p.goodput_aim, ">=")}
        if p.ideal:
            hit = _ratio(on, [figures(r) for r in runs_of(report, p.ideal)], "cached_share")
            if hit["ratio"] is not None:
                row.update(hit_vs_ideal=hit, ideal=p.ideal, hit_aim=p.hit_aim,
                           hit_met=_met(hit["ratio"], p.hit_aim, ">="))
        rows.append(row)
    return rows


def _met(ratio: float | None, aim: float | None, op: str) -> bool | None:
    if ratio is None or aim is None:
        return None
    return ratio <= aim if op == "<=" else ratio >= aim


def _cell(r: dict) -> str:
    if r["ratio"] is None:
        return "-"
    per = r["per_repeat"]
    return f"{r['ratio']:.2f}x" + (f" ({min(per):.2f}-{max(per):.2f})" if len(per) > 1 else "")


def _aim(aim: float | None, met: bool | None, op: str) -> str:
    if aim is None:
        return "-"
    return f"{op} {aim:g}: " + ("met" if met else "not met" if met is not None else "no figure")


def pair_table(rows: list[dict]) -> str:
    lines = ["| pair | on / off | runs | turns >= 2 TTFT p50 | aim | SLO goodput | aim | cached share vs ideal |",
             "|---|---|---:|---:|---|---:|---|---|"]
    for r in rows:
        hit = (f"{_cell(r['hit_vs_ideal'])} vs {r['ideal']} ({_aim(r['hit_aim'], r['hit_met'], '>=')})"
               if "hit_vs_ideal" in r else "-")
        lines.append(f"| {r['pair']} | {r['on']} / {r['off']} | {r['repeats']} | {_cell(r['ttft_later'])} | "
                     f"{_aim(r['ttft_aim'], r['ttft_met'], '<=')} | {_cell(r['goodput'])} | "
                     f"{_aim(r['goodput_aim'], r['goodput_met'], '>=')} | {hit} |")
    return "\n".join(lines)
