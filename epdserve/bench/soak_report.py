"""The soak's report: counters from the requests' outcomes, the memory table, JSON and Markdown.

Owns `tally(sent, expected)` (per kind and in all: sent, answered, lost — see soak_traffic for
what counts as lost —, compared and differing: an answered greedy request whose token ids, choice
by choice, are not the offline engine's; `sampled_json` replies a grammar ended that are not a
JSON object) and `markdown(report)`. `sent == answered + lost` by construction: every request
the load started is kept with its outcome.
"""
from __future__ import annotations

from collections import Counter

from epdserve.bench.soak_traffic import KINDS, Sent, invalid_json

EXAMPLES = 5  # differing / lost / invalid requests kept in full in the JSON


def tally(sent: list[Sent], expected: dict[str, list[list[int]]]) -> dict:
    by_kind = {k: {"sent": 0, "answered": 0, "lost": 0, "compared": 0, "differing": 0} for k in KINDS}
    errors: Counter = Counter()
    differing, lost, invalid = [], [], []
    sampled = {"answered": 0, "stopped": 0, "invalid_json": 0}
    for s in sent:
        row = by_kind[s.kind]
        row["sent"] += 1
        if not s.answered:
            row["lost"] += 1
            errors[s.error.split(":")[0]] += 1
            if len(lost) < EXAMPLES:
                lost.append({"item": s.item, "error": s.error})
            continue
        row["answered"] += 1
        if s.item in expected:
            row["compared"] += 1
            if s.choices != expected[s.item]:
                row["differing"] += 1
                if len(differing) < EXAMPLES:
                    differing.append({"item": s.item, "got": s.choices, "expected": expected[s.item]})
        elif s.kind == "sampled_json":
            sampled["answered"] += 1
            sampled["stopped"] += sum(1 for r in s.finish_reasons if r == "stop")
            if invalid_json(s):
                sampled["invalid_json"] += 1
                if len(invalid) < EXAMPLES:
                    invalid.append({"item": s.item, "token_ids": s.choices, "text": s.texts,
                                    "finish_reasons": s.finish_reasons})
    total = {f: sum(r[f] for r in by_kind.values()) for f in ("sent", "answered", "lost", "compared", "differing")}
    return {**total, "by_kind": by_kind, "lost_errors": dict(errors), "lost_examples": lost,
            "differing_examples": differing, "sampled_json": {**sampled, "invalid_examples": invalid}}


def _num(x, nd=1) -> str:
    return "-" if x is None else f"{x:.{nd}f}"


def markdown(rep: dict) -> str:
    r, cfg = rep["requests"], rep["config"]
    lines = [f"# soak: {cfg['mode']}, {cfg['duration_s'] / 60:g} min", "",
             f"- command: `{rep['command']}`", f"- date (UTC): {rep['date']}; commit: {rep.get('commit') or '-'}",
             f"- model: {cfg['model']}; {cfg['per_role']} instance(s) per role; {cfg['concurrency']} clients; "
             f"greedy requests {cfg['max_tokens']} tokens; one instance killed every {cfg['kill_every_s']:g} s "
             f"(roles {cfg['kill_roles']})",
             f"- machine: {rep['machine']['cpus']} CPUs; load average (1, 5, 15 min) after the warm-up "
             f"{rep['machine']['load_avg_1_5_15m']['start']}, at the end {rep['machine']['load_avg_1_5_15m']['end']}; "
             f"load ran {rep['load_s']:.0f} s",
             f"- lost: {rep['lost_definition']}", "",
             f"**sent {r['sent']}, answered {r['answered']}, lost {r['lost']}; compared with the offline engine "
             f"{r['compared']}, differing {r['differing']}; sampled json_object replies ended by the grammar "
             f"{r['sampled_json']['stopped']}, not a JSON object {r['sampled_json']['invalid_json']}**", "",
             "| kind | sent | answered | lost | compared | differing |", "|---|---:|---:|---:|---:|---:|"]
    for kind, k in r["by_kind"].items():
        lines.append(f"| {kind} | {k['sent']} | {k['answered']} | {k['lost']} | {k['compared']} | {k['differing']} |")
    lines += ["", "Kills (seconds after the load started; until the new process ran; until the roster was whole):",
              "", "| role | pid | at s | process back s | roster whole s |", "|---|---:|---:|---:|---:|"]
    for k in rep["kills"]:
        lines.append(f"| {k['role']} | {k['pid']} | {_num(k['t_s'], 0)} | {_num(k['process_s'])} | "
                     f"{_num(k['roster_s'])} |")
    lines += ["", "RSS (MiB) of every process after the warm-up and at the end (the scheduler process also "
              "serves the OpenAI HTTP front; aim: within +10 %, reported, not asserted):", "",
              "| process | pid start → end | start MiB | end MiB | growth % | restarted |",
              "|---|---|---:|---:|---:|---|"]
    for row in rep["rss"]:
        lines.append(f"| {row['slot']} | {row['pid_start']} → {row['pid_end'] or '-'} | {_num(row['start_mb'])} | "
                     f"{_num(row['end_mb'])} | {_num(row['growth_pct'])} | {'yes' if row['restarted'] else 'no'} |")
    if r["lost_errors"]:
        lines += ["", f"Lost, by error: {r['lost_errors']}"]
    return "\n".join(lines) + "\n"
