"""`epdserve bench ...`: each benchmark is a module with `add_parser(subparsers)` + `run(args)`,
listed in `BENCHMARKS` with its help line; only the one named on the command line is imported
(`epdserve.commands.add_commands`), so `epdserve bench --help` imports none of them."""
from __future__ import annotations

from epdserve.commands import Command, add_commands

BENCHMARKS = {
    "offline": Command("epdserve.bench.offline", "offline throughput: epdserve engine vs transformers generate "
                                                 "(1 at a time, padded batches, generate_batch)"),
    "host": Command("epdserve.bench.host", "host (Python) time per decode step at short vs long outputs"),
    "mm-store": Command("epdserve.bench.mm_store", "MM Store put/get vs raw redis-py set/get"),
    "kv-transfer": Command("epdserve.bench.kv_transfer_cli", "layerwise vs after-prefill P->D KV transfer, and raw gloo"),
    "serve": Command("epdserve.bench.serve",
                     "serving benchmark: TTFT/TPOT/ITL/E2EL, goodput under SLOs, modes side by side"),
    "ops": Command("epdserve.bench.ops", "paged operators: native (csrc/) vs portable torch"),
    "chaos": Command("epdserve.bench.chaos", "kill -9 instances, MM Store and scheduler under load; report losses"),
    "device": Command("epdserve.checks.device.check", "device check: exactness vs transformers, every mode served, decode "
                                               "speed vs transformers and the memory floor (GPU / NPU / CPU)"),
    "soak": Command("epdserve.bench.soak", "minutes of mixed traffic on E-P-D with instances killed: losses, "
                                           "outputs vs offline, RSS growth"),
    "colocation": Command("epdserve.bench.colocation", "decode step time with co-located encode busy vs idle, per policy"),
}


def add_parser(subparsers, argv: list[str] | None = None):
    """`argv`: the arguments after `bench` (only the benchmark they name is built); None: all."""
    p = subparsers.add_parser("bench", help="run a benchmark (writes JSON + a table)",
                              description="Benchmarks: each measures configurations side by side in one run.")
    sub = p.add_subparsers(dest="benchmark", required=True, metavar="BENCHMARK")
    add_commands(sub, BENCHMARKS, argv)
    return p
