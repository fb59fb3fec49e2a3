"""`epdserve bench ...`: each benchmark is a module with `add_parser(subparsers)` + `run(args)`."""
from __future__ import annotations

import importlib

BENCHMARKS = [
    "epdserve.bench.offline",  # offline: engine vs transformers generate
    "epdserve.bench.host",  # host: the engine's Python time per decode step, short vs long outputs
    "epdserve.bench.mm_store",  # mm-store: MMStore vs raw redis-py
    "epdserve.bench.kv_transfer",  # kv-transfer: layerwise vs after-prefill
    "epdserve.bench.serve",  # serve: modes side by side against live deployments (SLO goodput)
    "epdserve.bench.ops",  # ops: paged operators, native (csrc/) vs portable torch
    "epdserve.bench.chaos",  # chaos: kill -9 instances, MM Store and scheduler under load
    "epdserve.bench.colocation",  # colocation: decode with co-located encode busy vs idle, per policy
]


def add_parser(subparsers):
    p = subparsers.add_parser("bench", help="run a benchmark (writes JSON + a table)",
                              description="Benchmarks: each measures configurations side by side in one run.")
    sub = p.add_subparsers(dest="benchmark", required=True, metavar="BENCHMARK")
    for mod in BENCHMARKS:
        importlib.import_module(mod).add_parser(sub)
    return p
