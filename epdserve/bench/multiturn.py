"""`bench serve --workload multiturn`: its settings from the command line and one run of it.

Owns `add_arguments` (--conversations, --turns, --think-time-s), `multiturn_config` (the
`MultiturnConfig` of perf/multiturn.py with bench serve's shared workload knobs applied: images per
request, resolution mix and scale, output lengths, seed) and `run_multiturn` (one run against
one target: the conversations built for the run's seed, driven closed loop per conversation by
bench/multiturn_runner.py, and the per-turn figures of perf/turn_metrics.py for the run's entry).
The request rate of a multiturn run is conversations started per second.
"""
from __future__ import annotations

from epdserve.bench.multiturn_runner import run_conversations
from epdserve.bench.serve_runner import RunConfig
from epdserve.perf.multiturn import MultiturnConfig, build_conversations
from epdserve.perf.serving_metrics import SLO, RequestRecord
from epdserve.perf.turn_metrics import turn_metrics
from epdserve.perf.workload import parse_mix

DEFAULT = MultiturnConfig()


def add_arguments(group) -> None:
    group.add_argument("--conversations", type=int, help=f"with --workload multiturn: conversations per run "
                                                         f"(default {DEFAULT.conversations})")
    group.add_argument("--turns", type=int, help=f"with --workload multiturn: turns per conversation "
                                                 f"(default {DEFAULT.turns})")
    group.add_argument("--think-time-s", type=float, help="with --workload multiturn: seconds a conversation waits "
                                                          f"after an answer before its next turn "
                                                          f"(default {DEFAULT.think_time_s:g})")


def multiturn_config(args) -> MultiturnConfig:
    """The multiturn workload of bench serve's arguments (--num-requests and the share knobs do not apply)."""
    changes: dict = {"seed": args.seed}
    for arg, fld in (("conversations", "conversations"), ("turns", "turns"), ("think_time_s", "think_time_s"),
                     ("resolution_scale", "resolution_scale"), ("output_len", "output_len_mean"),
                     ("output_len_std", "output_len_std")):
        if getattr(args, arg, None) is not None:
            changes[fld] = getattr(args, arg)
    if getattr(args, "images_per_request", None):
        lo, _, hi = args.images_per_request.partition("-")
        changes.update(images_min=int(lo), images_max=int(hi or lo))
    if getattr(args, "resolution_mix", None):
        changes["resolution_mix"] = parse_mix(args.resolution_mix)
    if getattr(args, "output_len_range", None):
        lo, _, hi = args.output_len_range.partition("-")
        changes.update(output_len_min=int(lo), output_len_max=int(hi))
    elif getattr(args, "output_len", None) is not None:
        changes.update(output_len_min=1, output_len_max=max(int(2 * args.output_len), 1))
    try:
        return DEFAULT.with_(**changes)
    except ValueError as e:
        raise SystemExit(f"--workload multiturn: {e}") from None


def run_multiturn(backend, cfg: MultiturnConfig, rc: RunConfig, slo: SLO) -> tuple[list[RequestRecord], dict]:
    """One run: its records and the run entry's extra fields ({"turns": per-turn figures})."""
    records = run_conversations(backend, build_conversations(cfg), rc)
    return records, {"turns": turn_metrics(records, slo)}
