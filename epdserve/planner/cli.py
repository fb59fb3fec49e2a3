"""`epdserve plan`: predict every deployment mode's SLO goodput from a profile, pick one.

    epdserve plan --profile profile.json --workload image-heavy --rate 1.0 --requests 40 \\
                  --devices 2 --colocated-host --out plan.yaml
    epdserve launch --config plan.yaml --model DIR
    epdserve plan --profile profile.json --trace results.json --devices 4     # a recorded workload
    epdserve plan --profile profile.json --validate results.json --colocated-host

From `epdserve profile`'s per-stage costs (encode ms per vision token count, prefill ms per prompt
length, decode ms per batch size, bytes moved) and a workload (a `bench serve` preset with its
rate and request count, or the requests of a recorded `bench serve` run), a discrete-event
simulation predicts, for every mode and every E:P:D split that fits N devices, the goodput
(requests meeting TTFT and TPOT SLOs per second), output tok/s under the SLO and TTFT/TPOT
percentiles, computed by `bench serve`'s own metric functions. It prints the ranking and, with
--out, writes the winner as a launch config.

Devices are NPUs, GPUs or CPU core groups, each running at the profile's speed. By default each
instance gets a device of its own (its co-located workers share it); with the tensor-parallel flags
of `epdserve launch`, an instance of degree N takes N devices and runs at the costs of a profile
measured at N (give one --profile per degree: `epdserve profile --tensor-parallel-size N`). --colocated-host models one
machine where every instance shares the same cores (what `epdserve launch` does on a CPU host
without --pin-instances): a single device that runs one stage step at a time, a due decode step
first (TPOT pacing), then encode/prefill work oldest first; N then bounds each pool's instances.
Not modelled: KV cache capacity, the scheduler's CPU time, contention on the links (a transfer is
a fixed delay: --link-gbps, --link-latency-ms), and thread oversubscription between processes.

--validate RESULTS.json predicts every cell (workload x mode x rate) of a `bench serve` results
file with the instances that ran it and prints predicted against measured goodput.
"""
from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path

from epdserve.commands import add_command
from epdserve.engine.config import EngineConfig
from epdserve.settings import add_flags, from_flags
from epdserve.slo import SLO, SLO_FLAGS

DEFAULT_DEVICES = 2


def add_parser(subparsers) -> argparse.ArgumentParser:
    from epdserve.perf.presets import PRESETS
    from epdserve.instance.modes import DEGREE_FLAGS, MODES
    from epdserve.planner.costs import DEFAULT_LINK_GBPS, DEFAULT_LINK_LATENCY_MS

    p = add_command(subparsers, "plan", run,
                    "predict each mode's SLO goodput from a profile + workload; write the best as a launch config",
                    __doc__)
    p.add_argument("--profile", required=True, metavar="JSON", action="append",
                   help="`epdserve profile` output; once per tensor-parallel degree the deployment uses (each "
                        "profile says its degree: `epdserve profile --tensor-parallel-size N`)")
    w = p.add_argument_group("workload (one of --workload, --trace, --validate)")
    w.add_argument("--workload", metavar="NAME", help=f"a `bench serve` preset: {', '.join(PRESETS)}")
    w.add_argument("--rate", type=float, default=1.0, help="requests per second (default 1.0; inf: all at once)")
    w.add_argument("--requests", type=int, default=None, help="number of requests (default: the preset's)")
    w.add_argument("--burstiness", type=float, default=1.0, help="gamma shape of inter-arrivals (default 1: Poisson)")
    w.add_argument("--seed", type=int, default=0, help="workload and arrival seed (default 0, as bench serve)")
    w.add_argument("--model", metavar="DIR",
                   help="checkpoint whose tokenizer and image processor count a preset's tokens (no weights are "
                        "loaded; default: the profile's model)")
    w.add_argument("--trace", metavar="RESULTS.json",
                   help="take requests and arrivals from a `bench serve` results file instead of a preset")
    w.add_argument("--trace-workload", metavar="NAME", help="which workload of --trace (default the first)")
    w.add_argument("--trace-rate", type=float, help="which run of --trace, by its rate (default the first)")
    w.add_argument("--validate", metavar="RESULTS.json",
                   help="predict every cell of a `bench serve` results file (its instances, requests, arrivals and "
                        "SLO; --devices is not used) and compare with its measured goodput")
    d = p.add_argument_group("deployment")
    d.add_argument("--devices", type=int, default=DEFAULT_DEVICES,
                   help=f"NPUs / GPUs / CPU core groups to place instances on (default {DEFAULT_DEVICES})")
    d.add_argument("--colocated-host", action="store_true",
                   help="every instance shares one machine's cores (epdserve launch on one CPU host)")
    d.add_argument("--modes", default=",".join(MODES), help=f"modes to consider (default {','.join(MODES)})")
    for stage, flag in DEGREE_FLAGS.items():
        d.add_argument(flag, type=int, default=1 if stage in ("lm", "encode") else 0, dest=f"{stage}_degree",
                       help="as `epdserve launch`'s: an instance of degree N takes N devices"
                            + ("" if stage in ("lm", "encode") else " (0: --tensor-parallel-size)"))
    add_flags(d, EngineConfig, ["encode_token_budget", "max_num_batched_tokens", "max_num_seqs"])  # as the engines'
    d.add_argument("--link-gbps", type=float, default=DEFAULT_LINK_GBPS,
                   help=f"E->P and P->D link bandwidth, GB/s (default {DEFAULT_LINK_GBPS:g})")
    d.add_argument("--link-latency-ms", type=float, default=DEFAULT_LINK_LATENCY_MS,
                   help=f"fixed time per transfer (default {DEFAULT_LINK_LATENCY_MS:g})")
    s = p.add_argument_group("SLO and output")
    add_flags(s, SLO, SLO_FLAGS)
    s.add_argument("--top", type=int, default=None, help="print only the best K deployments")
    s.add_argument("--out", metavar="YAML", help="write the best deployment as an `epdserve launch --config` file")
    s.add_argument("--launch-device", default=None, help="`device:` of that config (default: the profile's platform)")
    s.add_argument("--json", metavar="PATH", help="also write the ranking (or validation) as JSON")
    return p


class PlanError(ValueError):
    """Bad input to `epdserve plan`."""


def _settings(args):
    from epdserve.planner.workers import Limits

    for name in ("devices", "encode_token_budget", "max_num_batched_tokens", "max_num_seqs"):
        if getattr(args, name) < 1:
            raise PlanError(f"--{name.replace('_', '-')} must be >= 1")
    try:
        slo = from_flags(SLO, args)
    except ValueError as e:
        raise PlanError(str(e)) from None
    return (slo,
            Limits(args.encode_token_budget, args.max_num_batched_tokens, args.max_num_seqs))


def _shapes(args, report: dict):
    from epdserve.planner.shapes import shapes_from_preset, shapes_from_trace

    if bool(args.workload) == bool(args.trace):
        raise PlanError("give one of --workload NAME, --trace RESULTS.json or --validate RESULTS.json")
    if args.trace:
        return shapes_from_trace(args.trace, args.trace_workload, args.trace_rate), f"trace {args.trace}"
    if not (args.rate > 0) or args.burstiness <= 0 or (args.requests is not None and args.requests < 1):
        raise PlanError("--rate and --burstiness must be > 0, --requests >= 1")
    model = args.model or report.get("model")
    if not model:
        raise PlanError("the profile names no model: pass --model DIR to count the workload's tokens")
    shapes = shapes_from_preset(args.workload, args.rate, model, args.requests, args.burstiness, args.seed)
    return shapes, f"{args.workload}, {len(shapes)} requests at {args.rate:g} req/s"


def _write_config(path: str, pred, launch_device: str, header: str) -> None:
    import yaml

    cfg = pred.deployment.launch_config(launch_device)
    text = "".join(f"# {line}\n" for line in header.splitlines()) + yaml.safe_dump(cfg, sort_keys=False)
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    Path(path).write_text(text)


def run(args: argparse.Namespace) -> int:
    from epdserve.instance.modes import MODES
    from epdserve.planner import rank, validate
    from epdserve.planner.costs import ProfileError, load_per_degree
    from epdserve.planner.deployment import StageDegrees
    from epdserve.planner.shapes import WorkloadError

    try:
        slo, limits = _settings(args)
        modes = tuple(m.strip() for m in args.modes.split(",") if m.strip())
        bad = [m for m in modes if m not in MODES]
        if bad or not modes:
            raise PlanError(f"unknown mode(s) {', '.join(bad) or '(none)'}; modes: {', '.join(MODES)}")
        per_degree, report = load_per_degree(args.profile, link_gbps=args.link_gbps,
                                             link_latency_ms=args.link_latency_ms)
        degrees = StageDegrees(args.lm_degree, args.encode_degree, args.prefill_degree, args.decode_degree)
        costs = per_degree[min(per_degree)]
        if args.validate:
            cells, skipped = validate.validate(args.validate, costs, args.colocated_host, None, limits)
            print(validate.table(cells, skipped))
            if args.json:
                rows = [{**c.__dict__, "rate": "inf" if math.isinf(c.rate) else c.rate, "error": c.error} for c in cells]
                Path(args.json).write_text(json.dumps({"cells": rows, "skipped": skipped}, indent=2) + "\n")
            return 0
        shapes, described = _shapes(args, report)
        preds = rank.rank(per_degree, shapes, args.devices, args.colocated_host, modes, slo, limits, degrees)
        if not preds:
            raise PlanError(f"no deployment of {', '.join(modes)} fits {args.devices} device(s) at "
                            f"{degrees.flags() or 'one device per instance'}")
    except (PlanError, ProfileError, WorkloadError, ValueError) as e:
        print(f"epdserve plan: error: {e}", file=sys.stderr)
        return 2
    place = "one shared host" if args.colocated_host else "a device per rank"
    if not degrees.single:
        place += f", {degrees.flags()}"
    print(f"## plan: {described}; {args.devices} device(s), {place}; SLO TTFT <= {slo.ttft_ms:g} ms, "
          f"TPOT <= {slo.tpot_ms:g} ms; profile {', '.join(args.profile)}\n")
    print(rank.table(preds, args.top))
    best = preds[0]
    print(f"\nbest: {best.deployment.mode} ({best.deployment.summary}), predicted goodput {best.goodput:.3f} req/s")
    if args.json:
        Path(args.json).write_text(json.dumps({"workload": described, "devices": args.devices,
                                               "colocated_host": args.colocated_host,
                                               "ranking": [p.row() for p in preds]}, indent=2) + "\n")
    if args.out:
        header = (f"written by epdserve plan: {described}; {args.devices} device(s), {place}\n"
                  f"predicted goodput {best.goodput:.3f} req/s, SLO attainment "
                  f"{100 * best.metrics['slo_attainment']:.0f}%\nepdserve launch --config {args.out} --model DIR")
        _write_config(args.out, best, args.launch_device or report.get("platform") or "cpu", header)
        print(f"wrote {args.out}")
    return 0
