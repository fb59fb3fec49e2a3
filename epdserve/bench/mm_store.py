"""`epdserve bench mm-store`: put/get throughput and latency of the MM Store against raw redis-py.

Both sides run in one process against the same server, interleaved iteration by iteration
(who goes first alternates; each side overwrites its own key) so a noisy machine hurts both
alike: raw redis-py SET/GET of a tensor's bytes, and `RedisMMStore` put/get of the same
tensor (encode + checksum + SET; GET + verify + decode into a fresh tensor).
MB/s counts payload bytes (the tensor; 1 MB = 1e6 bytes) at the median latency, one request at
a time (robust on a shared machine); the JSON also has the mean-based figure.
"""
from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path



def add_parser(subparsers) -> argparse.ArgumentParser:
    p = subparsers.add_parser("mm-store", help="MM Store put/get vs raw redis-py set/get",
                              description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--url", default=None, help="redis:// URL of a server to use (default: start a private one)")
    p.add_argument("--tokens", type=int, nargs="+", default=[256, 1024], help="tokens per image feature")
    p.add_argument("--hidden", type=int, default=3584, help="feature width (Qwen2-VL-7B: 3584)")
    p.add_argument("--iters", type=int, default=20, help="timed iterations per size")
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--out", default="mm_store_bench.json", help="JSON results file")
    p.set_defaults(func=run)
    return p


def run(args: argparse.Namespace) -> int:
    if args.iters < 1 or args.warmup < 0 or any(t < 1 for t in args.tokens) or args.hidden < 1:
        raise SystemExit("--iters, --tokens and --hidden must be positive, --warmup >= 0")
    from epdserve.transfer.mm_store import LocalRedisServer  # torch, redis: not imported for --help

    if args.url:
        rows = _bench_all(args.url, args)
    else:
        with LocalRedisServer() as server:
            rows = _bench_all(server.url, args)
    print(format_table(rows))
    result = {"benchmark": "mm-store", "hidden": args.hidden, "dtype": "bfloat16", "iters": args.iters,
              "hiredis": _hiredis(), "rows": rows}
    Path(args.out).write_text(json.dumps(result, indent=2))
    print(f"wrote {args.out}")
    return 0


def _bench_all(url: str, args: argparse.Namespace) -> list[dict]:
    import redis

    from epdserve.transfer.mm_store import RedisMMStore

    raw = redis.Redis.from_url(url)
    store = RedisMMStore(url, ttl_s=600, socket_timeout_s=10.0)
    rows = []
    try:
        for tokens in args.tokens:
            rows += _bench_size(raw, store, tokens, args.hidden, args.iters, args.warmup)
    finally:
        for k in raw.scan_iter("epdbench:*"):
            raw.delete(k)
        for k in raw.scan_iter(store.redis_key("epdbench:*")):
            raw.delete(k)
        raw.close()
        store.close()
    return rows


def _bench_size(raw: redis.Redis, store: RedisMMStore, tokens: int, hidden: int, iters: int, warmup: int):
    import torch

    feature = torch.randn(tokens, hidden).bfloat16()
    payload = feature.view(torch.int16).numpy().tobytes()
    times: dict[tuple[str, str], list[float]] = {(s, op): [] for s in ("redis-py", "MMStore") for op in ("put", "get")}
    raw_key, key = f"epdbench:raw:{tokens}", f"epdbench:{tokens}"  # overwritten: steady server memory
    for i in range(warmup + iters):
        puts = [(("redis-py", "put"), lambda: raw.set(raw_key, payload)),
                (("MMStore", "put"), lambda: store.put(key, [feature]))]
        gets = [(("redis-py", "get"), lambda: raw.get(raw_key)),
                (("MMStore", "get"), lambda: store.get(key))]
        if i % 2:  # alternate who goes first, so order effects cancel
            puts.reverse()
            gets.reverse()
        for name, fn in puts + gets:
            t0 = time.perf_counter()
            out = fn()
            dt = time.perf_counter() - t0
            if out is None or out is False:
                raise RuntimeError(f"{name} returned {out!r} for {tokens} tokens")
            if i >= warmup:
                times[name].append(dt)
    rows = []
    for (system, op), ts in times.items():
        p50 = statistics.median(ts)
        rows.append({
            "tokens": tokens, "mb": round(len(payload) / 1e6, 3), "system": system, "op": op,
            "mb_per_s": round(len(payload) / p50 / 1e6, 3),
            "mean_mb_per_s": round(len(payload) * len(ts) / sum(ts) / 1e6, 3),
            "p50_ms": round(p50 * 1e3, 3),
            "p90_ms": round(sorted(ts)[int(0.9 * (len(ts) - 1))] * 1e3, 3),
        })
    return rows


def format_table(rows: list[dict]) -> str:
    head = f"{'tokens':>6} {'MB':>6} {'op':>4} {'system':>9} {'MB/s':>8} {'p50 ms':>8} {'p90 ms':>8} {'vs raw':>7}"
    lines = [head, "-" * len(head)]
    raw = {(r["tokens"], r["op"]): r for r in rows if r["system"] == "redis-py"}
    for r in sorted(rows, key=lambda r: (r["tokens"], r["op"] != "put", r["system"] != "redis-py")):
        ratio = r["mb_per_s"] / max(raw[(r["tokens"], r["op"])]["mb_per_s"], 1e-9)
        lines.append(f"{r['tokens']:>6} {r['mb']:>6.2f} {r['op']:>4} {r['system']:>9} {r['mb_per_s']:>8.1f} "
                     f"{r['p50_ms']:>8.2f} {r['p90_ms']:>8.2f} {ratio:>6.0%}")
    return "\n".join(lines)


def _hiredis() -> bool:
    from redis.utils import HIREDIS_AVAILABLE

    return bool(HIREDIS_AVAILABLE)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="mm_store_bench")
    add_parser(parser.add_subparsers(dest="benchmark", required=True))
    args = parser.parse_args(["mm-store", *(argv or [])])
    return args.func(args)
