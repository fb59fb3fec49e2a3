"""Paged decode attention: the native kernel (csrc/cpu/paged_ops.cpp) against the portable ops
(gather the request's blocks + torch SDPA), fp32 and bf16, in one process.

Each case times the two back to back, interleaved repeat by repeat (so a busy machine slows
both alike), and prints the median with min and max in µs per call. Default shapes are those
of the demo-small model: heads 8, kv_heads 2, head_dim 64, block 16; every request of the
batch has the same context, its blocks scattered over the cache.

    python benchmarks/paged_attention_bench.py                  # B in {1, 32}, ctx in {64, 256, 1024}
    python benchmarks/paged_attention_bench.py --threads 1 --repeats 100 --json out.json
"""
from __future__ import annotations

import argparse
import json
import statistics
import time

import torch


def case(ops: dict, dtype, batch: int, ctx: int, heads: int, kv_heads: int, head_dim: int, block: int,
         repeats: int, inner: int, seed: int = 0) -> dict:
    gen = torch.Generator().manual_seed(seed)
    width = -(-ctx // block)
    nb = batch * width + 1
    kc = torch.randn(nb, block, kv_heads, head_dim, generator=gen).to(dtype)
    vc = torch.randn(nb, block, kv_heads, head_dim, generator=gen).to(dtype)
    tables = torch.randperm(nb, generator=gen)[: batch * width].view(batch, width)
    lens = torch.full((batch,), ctx)
    q = torch.randn(batch, heads, head_dim, generator=gen).to(dtype)
    scale = head_dim ** -0.5
    times = {name: [] for name in ops}
    for o in ops.values():  # warm-up (and the first-use build)
        o.decode_attention(q, kc, vc, tables, lens, scale)
    for _ in range(repeats):
        for name, o in ops.items():
            t = time.perf_counter()
            for _ in range(inner):
                o.decode_attention(q, kc, vc, tables, lens, scale)
            times[name].append((time.perf_counter() - t) / inner * 1e6)
    return {name: {"median_us": statistics.median(ts), "min_us": min(ts), "max_us": max(ts)}
            for name, ts in times.items()}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--batch", type=int, nargs="+", default=[1, 32])
    ap.add_argument("--ctx", type=int, nargs="+", default=[64, 256, 1024])
    ap.add_argument("--dtype", nargs="+", default=["float32", "bfloat16"])
    ap.add_argument("--heads", type=int, default=8)
    ap.add_argument("--kv-heads", type=int, default=2)
    ap.add_argument("--head-dim", type=int, default=64)
    ap.add_argument("--block", type=int, default=16)
    ap.add_argument("--repeats", type=int, default=50, help="timed repeats per case (>= 50 for the figures)")
    ap.add_argument("--inner", type=int, default=1, help="calls per timed repeat")
    ap.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    ap.add_argument("--json", default=None, help="also write the results here")
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)

    from epdserve.ops.native import load_native_ops
    from epdserve.ops.portable import PortableOps

    ops = {"native": load_native_ops(), "portable": PortableOps()}
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, heads {args.heads}, "
          f"kv_heads {args.kv_heads}, head_dim {args.head_dim}, block {args.block}, {args.repeats} repeats "
          f"x {args.inner} calls; µs per call: median [min, max]")
    print(f"{'dtype':>9} {'B':>3} {'ctx':>5} | {'native':>26} | {'portable':>26} | speed-up")
    rows = []
    for dt in args.dtype:
        for b in args.batch:
            for ctx in args.ctx:
                r = case(ops, getattr(torch, dt), b, ctx, args.heads, args.kv_heads, args.head_dim, args.block,
                         args.repeats, args.inner)
                cells = [f"{r[n]['median_us']:9.1f} [{r[n]['min_us']:7.1f}, {r[n]['max_us']:8.1f}]" for n in ops]
                speed = r["portable"]["median_us"] / r["native"]["median_us"]
                print(f"{dt:>9} {b:>3} {ctx:>5} | {cells[0]:>26} | {cells[1]:>26} | {speed:6.1f}x")
                rows.append({"dtype": dt, "batch": b, "ctx": ctx, **r})
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"torch": torch.__version__, "threads": torch.get_num_threads(), "args": vars(args),
                       "results": rows}, f, indent=1)


if __name__ == "__main__":
    main()
