"""Micro-benchmark of an LM layer's fused element-wise operators: portable torch vs native csrc/.

Decode shapes of the small demo model (epdserve/model/demo.py PRESETS['small']: hidden 512,
8 heads, 2 kv heads, head_dim 64, intermediate 3584) at batch 1 and 32, fp32 and bf16, in one
run: per operator the median time of one call (µs) over --repeats calls, with min and max, for
`PortableLayerOps` and `NativeLayerOps` (interleaved in rounds, so drift hits both alike), and
per layer the sum of a decode step's calls (2 x add_rms_norm, rotary, silu_and_mul).

    python benchmarks/layer_ops_bench.py [--repeats 500] [--threads N]
"""
from __future__ import annotations

import argparse
import os
import statistics
import time

import torch

from epdserve.model.demo import PRESETS
from epdserve.ops.layer_ops import PortableLayerOps
from epdserve.ops.native_layer_ops import load_native_layer_ops

EPS = 1e-6


def _cases(batch: int, dtype: torch.dtype):
    """(name, calls per layer step, fn(ops)) for one decode step of the small preset."""
    s = PRESETS["small"]
    hd = s.hidden // s.heads
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(batch, s.hidden, generator=gen).to(dtype)
    res = torch.randn(batch, s.hidden, generator=gen).to(dtype)
    w = (torch.rand(s.hidden, generator=gen) + 0.5).to(dtype)
    qkv = torch.randn(batch, (s.heads + 2 * s.kv_heads) * hd, generator=gen).to(dtype)
    q = qkv[:, : s.heads * hd].view(batch, s.heads, hd)
    k = qkv[:, s.heads * hd: (s.heads + s.kv_heads) * hd].view(batch, s.kv_heads, hd)
    ang = torch.rand(batch, hd // 2, generator=gen) * 100
    ang = torch.cat((ang, ang), dim=-1)
    cos, sin = ang.cos().to(dtype), ang.sin().to(dtype)
    hw = (torch.rand(hd, generator=gen) + 0.5).to(dtype)
    gu = torch.randn(batch, 2 * s.intermediate, generator=gen).to(dtype)
    # the in-place native calls keep writing the same buffers: values stay bounded (a norm, a rotation)
    return [
        ("add_rms_norm", 2, lambda o: o.add_rms_norm(x, res, w, EPS)),
        ("rms_norm (q heads)", 0, lambda o: o.rms_norm(q, hw, EPS)),
        ("rotary", 1, lambda o: o.rotary(q, k, cos, sin)),
        ("silu_and_mul", 1, lambda o: o.silu_and_mul(gu)),
    ]


def _time(fn, ops, repeats: int, warmup: int = 20) -> list[float]:
    for _ in range(warmup):
        fn(ops)
    out = []
    for _ in range(repeats):
        t0 = time.perf_counter_ns()
        fn(ops)
        out.append((time.perf_counter_ns() - t0) / 1e3)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeats", type=int, default=500, help="timed calls per operator and implementation (>= 200)")
    ap.add_argument("--rounds", type=int, default=5, help="interleaved rounds the repeats are split into")
    ap.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    portable, native = PortableLayerOps(), load_native_layer_ops()
    s = PRESETS["small"]
    print(f"layer ops, small demo preset (hidden {s.hidden}, heads {s.heads}/{s.kv_heads}, head_dim "
          f"{s.hidden // s.heads}, intermediate {s.intermediate}); torch {torch.__version__}, "
          f"{torch.get_num_threads()} threads, {args.repeats} calls each, load average at start "
          f"{os.getloadavg()[0]:.1f} on {os.cpu_count()} CPUs; µs per call: median [min, max]")
    print(f"{'dtype':<9}{'batch':>5}  {'op':<19}{'portable':>26}{'native':>26}{'speed-up':>10}")
    per_round = max(1, args.repeats // args.rounds)
    for dtype in (torch.float32, torch.bfloat16):
        for batch in (1, 32):
            layer = {"portable": 0.0, "native": 0.0}
            for name, per_layer, fn in _cases(batch, dtype):
                times = {"portable": [], "native": []}
                for _ in range(args.rounds):
                    for label, ops in (("portable", portable), ("native", native)):
                        times[label] += _time(fn, ops, per_round)
                med = {k: statistics.median(v) for k, v in times.items()}
                for k in layer:
                    layer[k] += per_layer * med[k]
                cells = [f"{med[k]:8.2f} [{min(v):7.2f}, {max(v):8.1f}]" for k, v in times.items()]
                print(f"{str(dtype).removeprefix('torch.'):<9}{batch:>5}  {name:<19}{cells[0]:>26}{cells[1]:>26}"
                      f"{med['portable'] / med['native']:>9.1f}x")
            print(f"{str(dtype).removeprefix('torch.'):<9}{batch:>5}  {'= per layer step':<19}"
                  f"{layer['portable']:>26.2f}{layer['native']:>26.2f}{layer['portable'] / layer['native']:>9.1f}x")


if __name__ == "__main__":
    main()
