"""The soak's memory readings: the resident set size of every process of a launched deployment.

Owns `rss_snapshot(launcher_pid)` (one reading: the launcher itself and each of its children,
told apart as `chaos_faults.children` does: "scheduler" — which also serves the OpenAI HTTP
front, launched with `--http-port` —, "mm_store", and each instance by its roles) and
`rss_table(start, end)`: one row per process slot of the start reading ("E#0", "E#1", ...,
numbered by pid within a kind), its RSS at start and at the end. A slot whose process was killed
and restarted is matched to its kind's new process (`restarted`: its end reading is of a younger
process than its start reading, so its growth says little about a leak).
"""
from __future__ import annotations

from dataclasses import asdict, dataclass

import psutil

from epdserve.bench import chaos_faults as faults

MIB = 1 << 20


@dataclass(frozen=True)
class Reading:
    slot: str  # "launcher", "scheduler", "mm_store", "E#0", ...
    kind: str
    pid: int
    rss_mb: float | None  # None: the process could not be read (gone between listing and reading)


def _rss_mb(p: psutil.Process) -> float | None:
    try:
        return round(p.memory_info().rss / MIB, 1)
    except psutil.Error:
        return None


def rss_snapshot(launcher_pid: int) -> list[Reading]:
    launcher = psutil.Process(launcher_pid)
    out = [Reading("launcher", "launcher", launcher_pid, _rss_mb(launcher))]
    kids = faults.children(launcher_pid)
    by_kind: dict[str, list[psutil.Process]] = {}
    for kind, p in kids:
        by_kind.setdefault(kind, []).append(p)
    for kind in sorted(by_kind):
        procs = sorted(by_kind[kind], key=lambda p: p.pid)
        for i, p in enumerate(procs):
            slot = kind if kind in ("scheduler", "mm_store") and len(procs) == 1 else f"{kind}#{i}"
            out.append(Reading(slot, kind, p.pid, _rss_mb(p)))
    return out


@dataclass
class RssRow:
    slot: str
    kind: str
    pid_start: int
    pid_end: int | None
    start_mb: float | None
    end_mb: float | None
    restarted: bool
    growth_pct: float | None  # (end - start) / start, percent; None where either reading is missing

    def to_dict(self) -> dict:
        return asdict(self)


def rss_table(start: list[Reading], end: list[Reading]) -> list[RssRow]:
    """Each start slot with its end reading: the same pid if it still runs, else (restarted) the
    next of its kind's processes that no start slot holds."""
    end_by_pid = {r.pid: r for r in end}
    start_pids = {r.pid for r in start}
    fresh: dict[str, list[Reading]] = {}
    for r in end:
        if r.pid not in start_pids:
            fresh.setdefault(r.kind, []).append(r)
    rows = []
    for s in start:
        e = end_by_pid.get(s.pid)
        restarted = e is None
        if e is None and fresh.get(s.kind):
            e = fresh[s.kind].pop(0)
        growth = None
        if e is not None and s.rss_mb and e.rss_mb is not None:
            growth = round(100.0 * (e.rss_mb - s.rss_mb) / s.rss_mb, 1)
        rows.append(RssRow(s.slot, s.kind, s.pid, None if e is None else e.pid, s.rss_mb,
                           None if e is None else e.rss_mb, restarted, growth))
    return rows
