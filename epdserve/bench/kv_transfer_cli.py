"""`epdserve bench kv-transfer`: how much of the P→D KV transfer layerwise sending hides.

One run, per KV shape, between this process (prefill side) and a decode peer subprocess over
a real gloo pair on loopback:
- raw: one gloo send of a buffer as big as the request's KV, plus a 1-byte acknowledgement
  (the bandwidth reference);
- after: the prefill's layers compute, then the same KV goes through KVSender in one go;
- layerwise: each layer's KV is sent (isend) as soon as that layer is done, while the next
  layer computes.
"tail" is the time from the end of the prefill's last layer to D holding every layer (P sees
D's acknowledgement); hidden = 1 - tail(layerwise) / tail(after). The prefill time itself is
reported too: on CPU, gloo copies part of each send on the calling thread, so layerwise
sending lengthens the prefill a little (a device backend sends from its own stream). Layer compute is simulated
with real matmuls for `--layer-ms` per layer (`--engine` uses the real model instead).
Modes alternate round by round; medians are reported. D checks every round bit for bit.

This module is the command's parser alone (imports nothing heavy, so `--help` is instant); the run
is in kv_transfer.py.
"""
from __future__ import annotations

import argparse

# name: (num_layers, num_kv_heads, head_dim, dtype)
SHAPES = {
    "demo-small": (8, 2, 64, "float32"),  # the small demo model as the CPU engine runs it
    "qwen2-vl-2b": (28, 2, 128, "bfloat16"),
    "qwen2-vl-7b": (28, 4, 128, "bfloat16"),
}
MODES = ("layerwise", "after")


def add_parser(subparsers) -> argparse.ArgumentParser:
    p = subparsers.add_parser("kv-transfer", help="layerwise vs after-prefill P->D KV transfer, and raw gloo",
                              description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_args(p)
    p.set_defaults(func=_run)
    return p


def add_args(p: argparse.ArgumentParser) -> None:
    from epdserve.engine.config import EngineConfig
    from epdserve.settings import add_flags

    p.add_argument("--shapes", nargs="+", default=["demo-small", "qwen2-vl-7b"], choices=sorted(SHAPES))
    p.add_argument("--tokens", type=int, default=300, help="prompt tokens of the request")
    add_flags(p, EngineConfig, ["block_size"])  # default: the CPU platform's (this bench runs on CPU)
    p.add_argument("--layer-ms", type=float, default=40.0,
                   help="simulated compute per layer (ms); 40 = measured, small demo model, 311-token prompt "
                        "with an image, one CPU thread")
    p.add_argument("--repeats", type=int, default=7, help="timed rounds per mode")
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--timeout-s", type=float, default=30.0, help="KV transfer stall timeout")
    p.add_argument("--engine", default=None, metavar="MODEL_DIR",
                   help="also run a real prefill-only engine on this checkpoint (e.g. a `demo-model --size small`)")
    p.add_argument("--image-px", type=int, default=224, help="engine mode: side of the square prompt image")
    p.add_argument("--out", default="kv_transfer_bench.json", help="JSON results file")


def _run(args: argparse.Namespace) -> int:
    from epdserve.bench.kv_transfer import run

    return run(args)
