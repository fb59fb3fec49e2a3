"""`epdserve bench ops`: each paged operator, native (csrc/) against portable (torch), in one run.

Decode attention at batch 1/8/32/64 x context 256/1024/4096, a later prefill chunk (256 query
tokens, the native kernel itself: `NativeOps` hands chunks longer than `prefill_native_max` to
the portable SDPA path, which this row shows is faster for them) against the same contexts, and
reshape_and_cache of one decode step's K/V. The cache has
the demo-small model's attention shape unless `--shape` says otherwise, fp32, block size 16,
every request's blocks scattered at random (as a running engine leaves them). Each cell times
native and portable alternately (`--repeats` pairs, after warm-up) and reports the median time of
each and the ratio portable / native with its spread (25th-75th percentile of the per-pair
ratios): a ratio above 1 means the native operator is faster.
"""
from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

SHAPES = {  # heads, kv_heads, head_dim
    "demo-small": (8, 2, 64),
    "qwen2-vl-7b": (28, 4, 128),
}
BLOCK = 16


def add_parser(subparsers) -> argparse.ArgumentParser:
    p = subparsers.add_parser("ops", help="paged operators: native (csrc/) vs portable torch",
                              description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shape", choices=sorted(SHAPES), default="demo-small", help="attention shape of the cache")
    p.add_argument("--batches", type=int, nargs="+", default=[1, 8, 32, 64])
    p.add_argument("--contexts", type=int, nargs="+", default=[256, 1024, 4096])
    p.add_argument("--chunk", type=int, default=256, help="query tokens of the prefill chunk")
    p.add_argument("--repeats", type=int, default=7, help="timed native/portable pairs per cell")
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--out", default="ops_bench.json", help="JSON results file")
    p.set_defaults(func=run)
    return p


def _time(fn) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def _compare(native_fn, portable_fn, repeats: int, warmup: int) -> dict:
    for _ in range(warmup):
        native_fn(), portable_fn()
    nat, por = [], []
    for i in range(repeats):  # alternate which goes first
        pair = (native_fn, portable_fn) if i % 2 == 0 else (portable_fn, native_fn)
        a, b = (_time(f) for f in pair)
        nat.append(a if i % 2 == 0 else b)
        por.append(b if i % 2 == 0 else a)
    ratios = sorted(p / n for p, n in zip(por, nat))
    q = statistics.quantiles(ratios, n=4) if len(ratios) > 1 else [ratios[0]] * 3
    return {"native_ms": statistics.median(nat) * 1e3, "portable_ms": statistics.median(por) * 1e3,
            "ratio": statistics.median(ratios), "ratio_p25": q[0], "ratio_p75": q[2]}


def _cells(args, heads: int, kv_heads: int, head_dim: int):
    import torch  # here and in run, not at the top: `epdserve bench ops --help` stays light

    from epdserve.ops.native import load_native_ops
    from epdserve.ops.portable import PortableOps

    native, portable = load_native_ops(), PortableOps()
    gen = torch.Generator().manual_seed(0)
    scale = head_dim ** -0.5
    for ctx in args.contexts:
        per_req = -(-ctx // BLOCK)
        max_batch = max(args.batches)
        nb = per_req * max_batch + 1
        kc = torch.randn(nb, BLOCK, kv_heads, head_dim, generator=gen)
        vc = torch.randn(nb, BLOCK, kv_heads, head_dim, generator=gen)
        tables_all = torch.randperm(nb, generator=gen)[: per_req * max_batch].view(max_batch, per_req)
        for batch in args.batches:
            q = torch.randn(batch, heads, head_dim, generator=gen)
            tables, lens = tables_all[:batch].contiguous(), torch.full((batch,), ctx)
            yield "decode_attention", batch, ctx, _compare(
                lambda: native.decode_attention(q, kc, vc, tables, lens, scale),
                lambda: portable.decode_attention(q, kc, vc, tables, lens, scale), args.repeats, args.warmup)
            k, v = torch.randn(batch, kv_heads, head_dim, generator=gen), torch.randn(batch, kv_heads, head_dim)
            slots = tables[:, -1] * BLOCK + (ctx - 1) % BLOCK
            yield "reshape_and_cache", batch, ctx, _compare(
                lambda: native.reshape_and_cache(k, v, kc, vc, slots),
                lambda: portable.reshape_and_cache(k, v, kc, vc, slots), args.repeats, args.warmup)
        chunk = min(args.chunk, ctx)
        qc = torch.randn(chunk, heads, head_dim, generator=gen)
        table = tables_all[0]
        yield "prefill_attention", 1, ctx, _compare(  # the kernel itself, whatever NativeOps dispatches to
            lambda: torch.ops.epdserve.paged_prefill_attention(qc, kc, vc, table, ctx, scale),
            lambda: portable.prefill_attention(qc, kc, vc, table, ctx, scale), args.repeats, args.warmup)


def format_table(rows: list[dict]) -> str:
    head = f"{'operator':<18} {'batch':>5} {'context':>7} {'native ms':>10} {'portable ms':>11} {'portable/native':>16}"
    lines = [head, "-" * len(head)]
    for r in rows:
        lines.append(f"{r['op']:<18} {r['batch']:>5} {r['context']:>7} {r['native_ms']:>10.3f} {r['portable_ms']:>11.3f} "
                     f"{r['ratio']:>7.2f} [{r['ratio_p25']:.2f}-{r['ratio_p75']:.2f}]")
    return "\n".join(lines)


def run(args: argparse.Namespace) -> int:
    if args.repeats < 1 or args.warmup < 0 or min(args.batches + args.contexts) < 1:
        raise SystemExit("--repeats, --batches and --contexts must be positive, --warmup >= 0")
    import torch

    heads, kv_heads, head_dim = SHAPES[args.shape]
    rows = [{"op": op, "batch": b, "context": c, **r} for op, b, c, r in _cells(args, heads, kv_heads, head_dim)]
    print(format_table(rows))
    result = {"benchmark": "ops", "shape": args.shape, "heads": heads, "kv_heads": kv_heads, "head_dim": head_dim,
              "dtype": "float32", "block_size": BLOCK, "torch_threads": torch.get_num_threads(),
              "repeats": args.repeats, "rows": rows}
    Path(args.out).write_text(json.dumps(result, indent=2))
    print(f"wrote {args.out}")
    return 0
