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
"""
from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch

from epdserve.engine.kv_cache import KVCacheSpec, PagedKVCache
from epdserve.platform import get_platform
from epdserve.transfer.kv import (
    KVReceiver, KVSender, KVTransferConfig, PairConnection, PairRendezvous, RecvRequest, RendezvousServer,
    SendRequest, TransferState,
)
from epdserve.transfer.kv.checks import blocks_digest, fill_random

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
    _add_args(p)
    p.set_defaults(func=run)
    return p


def _add_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--shapes", nargs="+", default=["demo-small", "qwen2-vl-7b"], choices=sorted(SHAPES))
    p.add_argument("--tokens", type=int, default=300, help="prompt tokens of the request")
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--layer-ms", type=float, default=5.0, help="simulated compute per layer (ms)")
    p.add_argument("--repeats", type=int, default=7, help="timed rounds per mode")
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--timeout-s", type=float, default=30.0, help="KV transfer stall timeout")
    p.add_argument("--out", default="kv_transfer_bench.json", help="JSON results file")


def run(args: argparse.Namespace) -> int:
    if args.tokens < 1 or args.block_size < 1 or args.repeats < 1 or args.warmup < 0 or args.layer_ms < 0:
        raise SystemExit("--tokens, --block-size, --repeats must be positive; --warmup, --layer-ms >= 0")
    torch.set_num_threads(1)  # one core computes; gloo's IO thread and the peer get the rest
    rows = [bench_shape(name, args) for name in args.shapes]
    print(format_table(rows))
    Path(args.out).write_text(json.dumps({"benchmark": "kv-transfer", "rows": rows}, indent=2))
    print(f"wrote {args.out}")
    return 0


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["--peer"]:
        return _decode_peer(json.loads(argv[1]))
    p = argparse.ArgumentParser(prog="kv_transfer_bench", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    _add_args(p)
    return run(p.parse_args(argv))


# ---------------------------------------------------------------------------- prefill side (this process)
def _spec(shape: str, block_size: int) -> KVCacheSpec:
    layers, heads, dim, dtype = SHAPES[shape]
    return KVCacheSpec(layers, heads, dim, block_size, getattr(torch, dtype))


def bench_shape(shape: str, args: argparse.Namespace) -> dict:
    spec = _spec(shape, args.block_size)
    nblocks = -(-args.tokens // spec.block_size)
    kv_bytes = spec.bytes_per_block() * nblocks
    rounds = args.warmup + args.repeats
    # Modes alternate which goes first; D receives into two block sets in turn, so it can
    # hash one request while the next one lands.
    order = [(m, f"{m}-{i}") for i in range(rounds) for m in (MODES if i % 2 == 0 else MODES[::-1])]
    dst = [tuple(range((k % 2) * nblocks, (k % 2 + 1) * nblocks)) for k in range(len(order))]
    cfg = KVTransferConfig(timeout_s=args.timeout_s, bootstrap_timeout_s=600.0, connect_timeout_s=60.0)
    cpu = get_platform("cpu")
    server = RendezvousServer()
    cache = PagedKVCache(spec, nblocks)
    sender = KVSender(cache, cpu, cfg)
    blocks = tuple(range(nblocks))
    peer_cfg = dict(shape=shape, block_size=args.block_size, num_blocks=nblocks, tokens=args.tokens,
                    kv=server.rendezvous("bench-kv").for_peer().to_json(),
                    raw=server.rendezvous("bench-raw").for_peer().to_json(),
                    raw_bytes=kv_bytes, raw_rounds=rounds, requests=[[rid, list(d)] for (_, rid), d in zip(order, dst)],
                    timeout_s=args.timeout_s)
    peer = subprocess.Popen([sys.executable, "-m", "epdserve.bench.kv_transfer", "--peer", json.dumps(peer_cfg)],
                            stdout=subprocess.PIPE, text=True)
    raw_pair = PairConnection(server.rendezvous("bench-raw"), cpu, cfg)
    try:
        kv_pair = sender.connect("d0", server.rendezvous("bench-kv"))
        if not (raw_pair.wait_ready(60) and kv_pair.wait_ready(60)):
            raise RuntimeError(f"decode peer did not connect: {raw_pair.error or kv_pair.error}")
        raw = _raw_rounds(raw_pair, kv_bytes, rounds)[args.warmup:]
        compute = _Compute(args.layer_ms)
        times: dict[str, list[tuple[float, float]]] = {m: [] for m in MODES}
        digests = {}
        for (mode, rid), d in zip(order, dst):
            for layer in range(spec.num_layers):
                fill_random(cache, layer, blocks, seed=len(digests) + 1)
            digests[rid] = blocks_digest(cache, blocks)
            req = SendRequest(rid, "d0", blocks, d, args.tokens)
            times[mode].append(_kv_round(sender, req, spec.num_layers, compute, layerwise=mode == "layerwise"))
        out, _ = peer.communicate(timeout=60)
        peer_digests = json.loads(out.strip().splitlines()[-1])["digests"]
    finally:
        sender.close()
        raw_pair.close()
        if peer.poll() is None:
            peer.kill()
            peer.wait(10)
        server.close()
    bad = [rid for rid in digests if peer_digests.get(rid) != digests[rid]]
    if bad:
        raise RuntimeError(f"decode peer's KV differs from the prefill's for {bad}")
    med = {m: statistics.median(t[1] for t in times[m][args.warmup:]) for m in MODES}
    pre = {m: statistics.median(t[0] for t in times[m][args.warmup:]) for m in MODES}
    e2e = {m: statistics.median(a + b for a, b in times[m][args.warmup:]) for m in MODES}
    raw_s = statistics.median(raw)
    return {
        "shape": shape, "layers": spec.num_layers, "kv_heads": spec.num_kv_heads, "head_dim": spec.head_dim,
        "dtype": SHAPES[shape][3], "tokens": args.tokens, "kv_bytes": kv_bytes, "layer_ms": args.layer_ms,
        "repeats": args.repeats, "raw_ms": raw_s * 1e3, "raw_MBps": kv_bytes / raw_s / 1e6,
        "after_tail_ms": med["after"] * 1e3, "after_MBps": kv_bytes / med["after"] / 1e6,
        "layerwise_tail_ms": med["layerwise"] * 1e3,
        "prefill_ms_after": pre["after"] * 1e3, "prefill_ms_layerwise": pre["layerwise"] * 1e3,
        "e2e_ms_after": e2e["after"] * 1e3, "e2e_ms_layerwise": e2e["layerwise"] * 1e3,
        "hidden_pct": 100.0 * (1.0 - med["layerwise"] / med["after"]),
        "bit_exact": True,
    }


class _Compute:
    """Stands for one layer's compute: real matmuls for `ms` milliseconds."""

    def __init__(self, ms: float):
        self.s = ms / 1e3
        self.a = torch.randn(128, 128)

    def layer(self) -> None:
        end = time.perf_counter() + self.s
        while time.perf_counter() < end:
            self.a = torch.tanh(self.a @ self.a)


def _kv_round(sender: KVSender, req: SendRequest, num_layers: int, compute: _Compute, layerwise: bool):
    """(prefill seconds, tail seconds) of one request: tail = last layer done → D acknowledged."""
    t0 = time.perf_counter()
    if layerwise:
        sender.begin_batch([req])
    for layer in range(num_layers):
        compute.layer()
        if layerwise:
            sender.save_layer(layer)
    t_end = time.perf_counter()
    if not layerwise:
        sender.begin_batch([req])
        for layer in range(num_layers):
            sender.save_layer(layer)
    while True:
        st = sender.status(req.request_id)
        if st.state.finished:
            break
        time.sleep(0.0001)
    t_ready = time.perf_counter()
    sender.pop_finished()
    if st.state is not TransferState.DONE:
        raise RuntimeError(f"transfer {req.request_id} failed: {st.error}")
    return t_end - t0, t_ready - t_end


def _raw_rounds(pair: PairConnection, nbytes: int, rounds: int) -> list[float]:
    buf, ack = torch.randint(0, 255, (nbytes,), dtype=torch.uint8), torch.zeros(1, dtype=torch.uint8)
    out = []
    for _ in range(rounds):
        t0 = time.perf_counter()
        pair.wait(pair.isend(buf), "raw send")
        pair.wait(pair.irecv(ack), "raw ack")
        out.append(time.perf_counter() - t0)
    return out


def format_table(rows: list[dict]) -> str:
    head = (f"{'shape':<12} {'KV MB':>7} {'raw ms':>7} {'raw MB/s':>9} {'after tail':>11} {'after MB/s':>11} "
            f"{'layerwise tail':>15} {'hidden':>7} {'prefill ms (after/lw)':>22} {'prefill->D ready ms (after/lw)':>31}")
    lines = [head, "-" * len(head)]
    for r in rows:
        lines.append(
            f"{r['shape']:<12} {r['kv_bytes'] / 1e6:>7.2f} {r['raw_ms']:>7.2f} {r['raw_MBps']:>9.0f} "
            f"{r['after_tail_ms']:>9.2f}ms {r['after_MBps']:>11.0f} {r['layerwise_tail_ms']:>13.2f}ms "
            f"{r['hidden_pct']:>6.1f}% {r['prefill_ms_after']:>10.1f} / {r['prefill_ms_layerwise']:<9.1f} "
            f"{r['e2e_ms_after']:>15.1f} / {r['e2e_ms_layerwise']:<13.1f}")
    return "\n".join(lines)


# ---------------------------------------------------------------------------- decode side (subprocess)
def _decode_peer(cfg: dict) -> int:
    torch.set_num_threads(1)
    spec = _spec(cfg["shape"], cfg["block_size"])
    cache = PagedKVCache(spec, 2 * cfg["num_blocks"])
    kcfg = KVTransferConfig(timeout_s=cfg["timeout_s"], bootstrap_timeout_s=600.0, connect_timeout_s=60.0)
    cpu = get_platform("cpu")
    raw = PairConnection(PairRendezvous.from_json(cfg["raw"]), cpu, kcfg)
    rx = KVReceiver(cache, cpu, kcfg)
    rx.connect("p0", PairRendezvous.from_json(cfg["kv"]))
    try:
        if not raw.wait_ready(60):
            raise RuntimeError(raw.error)
        buf, ack = torch.empty(cfg["raw_bytes"], dtype=torch.uint8), torch.ones(1, dtype=torch.uint8)
        for _ in range(cfg["raw_rounds"]):
            raw.wait(raw.irecv(buf), "raw recv")
            raw.wait(raw.isend(ack), "raw ack")
        dst = {rid: tuple(blocks) for rid, blocks in cfg["requests"]}
        for rid, blocks in dst.items():
            rx.expect(RecvRequest(rid, "p0", blocks, cfg["tokens"]))
        digests: dict[str, str] = {}
        deadline = time.monotonic() + 600
        while len(digests) < len(dst) and time.monotonic() < deadline:
            for st in rx.pop_finished():
                ok = st.state is TransferState.DONE
                digests[st.request_id] = blocks_digest(cache, dst[st.request_id]) if ok else f"failed: {st.error}"
            time.sleep(0.0005)
        print(json.dumps({"digests": digests}), flush=True)
        return 0
    finally:
        rx.close()
        raw.close()


if __name__ == "__main__":
    sys.exit(main())
