"""The runner of `epdserve bench kv-transfer` (its flags and what it measures: kv_transfer_cli.py):
the prefill side in this process, the decode peer as `python -m epdserve.bench.kv_transfer --peer`.
As in an instance, the prefill side uses its pair store in process and the peer reaches it over
gRPC (`KvStore`, on a `RendezvousServer` here).
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
    KVReceiver, KVSender, KVTransferConfig, LayerwiseSendConnector, PairConnection, PairNetwork, PairRendezvous,
    PairStoreHost, RecvRequest, RendezvousServer, SendRequest, TransferState,
)
from epdserve.bench import kv_transfer_cli
from epdserve.bench.kv_transfer_cli import MODES, SHAPES, add_args
from epdserve.transfer.kv.checks import blocks_digest, fill_random


def run(args: argparse.Namespace) -> int:
    if args.block_size is None:
        from epdserve.platform import get_platform

        args.block_size = get_platform("cpu").kv_block_size
    if args.tokens < 1 or args.block_size < 1 or args.repeats < 1 or args.warmup < 0 or args.layer_ms < 0:
        raise SystemExit("--tokens, --block-size, --repeats must be positive; --warmup, --layer-ms >= 0")
    torch.set_num_threads(1)  # one core computes; gloo's IO thread and the peer get the rest
    rows = [bench_shape(name, args) for name in args.shapes]
    if args.engine:
        rows.append(bench_engine(args))
    print(format_table(rows))
    Path(args.out).write_text(json.dumps({"benchmark": "kv-transfer", "rows": rows}, indent=2))
    print(f"wrote {args.out}")
    return 0


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["--peer"]:
        return _decode_peer(json.loads(argv[1]))
    p = argparse.ArgumentParser(prog="kv_transfer_bench", description=kv_transfer_cli.__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    add_args(p)
    return run(p.parse_args(argv))


# ---------------------------------------------------------------------------- prefill side (this process)
def _spec(shape: str, block_size: int) -> KVCacheSpec:
    layers, heads, dim, dtype = SHAPES[shape]
    return KVCacheSpec(layers, heads, dim, block_size, getattr(torch, dtype))


class _SimulatedPrefill:
    """Random KV in fixed blocks; each layer's compute is real matmuls for `layer_ms`."""

    def __init__(self, spec: KVCacheSpec, tokens: int, layer_ms: float, cfg: KVTransferConfig):
        self.spec, self.tokens, self.s = spec, tokens, layer_ms / 1e3
        self.cache = PagedKVCache(spec, -(-tokens // spec.block_size))
        self.sender = KVSender(self.cache, get_platform("cpu"), cfg)
        self.src = tuple(range(self.cache.num_blocks))
        self.a = torch.randn(128, 128)
        self.seed = 0

    def _compute(self) -> None:
        end = time.perf_counter() + self.s
        while time.perf_counter() < end:
            self.a = torch.tanh(self.a @ self.a)

    def round(self, sender: KVSender, rid: str, dst: tuple[int, ...], layerwise: bool):
        self.seed += 1
        for layer in range(self.spec.num_layers):
            fill_random(self.cache, layer, self.src, self.seed)
        req = SendRequest(rid, "d0", self.src, dst, self.tokens)
        t0 = time.perf_counter()
        if layerwise:
            sender.begin_batch([req])
        for layer in range(self.spec.num_layers):
            self._compute()
            if layerwise:
                sender.save_layer(layer)
        t_end = time.perf_counter()
        if not layerwise:
            _send_all(sender, req, self.spec.num_layers)
        t_ready = _wait_done(sender, rid)
        return t_end - t0, t_ready - t_end, blocks_digest(self.cache, self.src)

    def close(self) -> None:
        self.sender.close()


class _EnginePrefill:
    """A prefill-only LLMEngine whose layerwise send connector sends each layer as it is computed
    ("layerwise"), or all layers once the forward is done ("after")."""

    def __init__(self, model_dir: str, tokens: int, block_size: int, image_px: int, cfg: KVTransferConfig):
        from epdserve.engine.config import EngineConfig
        from epdserve.engine.llm_engine import LLMEngine
        from epdserve.model.demo_images import jpeg_bytes, procedural_image

        self.conn = _RecordingSendConnector(cfg)
        self.eng = LLMEngine(EngineConfig(model=model_dir, device="cpu", roles="EP", block_size=block_size),
                             kv_connector=self.conn)
        self.sender = self.conn.sender
        self.spec = self.eng.kv_cache.spec
        self.cache = self.eng.kv_cache
        self.images = [jpeg_bytes(procedural_image(image_px, image_px, 1))]
        sentence = "the quick brown fox jumps over the lazy dog "
        for reps in range(1, 1000):  # grow the text until the prompt reaches `tokens`
            self.prompt = "<|vision_start|><|image_pad|><|vision_end|> describe it. " + sentence * reps
            self.tokens = len(self.eng.processor.process(self.prompt, self.images).token_ids)
            if self.tokens >= tokens:
                break

    def round(self, sender: KVSender, rid: str, dst: tuple[int, ...], layerwise: bool):
        from epdserve.seams.kv_connector import RemoteDecode
        from epdserve.engine.sampling_params import SamplingParams

        eng = self.eng
        self.conn.layerwise = layerwise
        req = eng.build_request(rid, self.prompt, self.images, SamplingParams(max_tokens=2, ignore_eos=True))
        req.kv_transfer = RemoteDecode("d0", dst)
        eng.add_request(req)
        t0 = time.perf_counter()
        finished = False
        while not finished:
            for out in eng.step():
                if out.error:
                    raise RuntimeError(f"prefill of {rid} failed: {out.error}")
                finished |= out.request_id == rid and out.finished
        t_end = time.perf_counter()
        while eng.has_pending_transfers():  # the engine holds the blocks until D acknowledged
            for out in eng.step():
                if out.error:
                    raise RuntimeError(f"transfer of {rid} failed: {out.error}")
        t_ready = time.perf_counter()
        if self.conn.failed:
            raise RuntimeError(f"transfer {rid} failed: {self.conn.failed}")
        return t_end - t0, t_ready - t_end, blocks_digest(self.cache, self.conn.sources.pop(rid)[: len(dst)])

    def close(self) -> None:
        self.conn.close()


class _RecordingSendConnector(LayerwiseSendConnector):
    """The engine's send connector, plus what the benchmark checks: each request's source blocks
    (for the bit-exactness digest) and failures; `layerwise=False` posts all layers after the forward."""

    def __init__(self, cfg: KVTransferConfig):
        super().__init__(cfg)
        self.layerwise = True
        self.sources: dict[str, tuple[int, ...]] = {}
        self.failed: list[str] = []

    def build_step(self, batch) -> None:
        self.sources.update((i.seq.request_id, tuple(i.block_ids)) for i in batch if i.end == i.seq.prompt_len)
        super().build_step(batch)

    def save_kv_layer(self, layer: int) -> None:
        if self.layerwise:
            super().save_kv_layer(layer)

    def wait_for_save(self) -> None:
        if not self.layerwise:
            for layer in range(self.sender.cache.spec.num_layers):
                super().save_kv_layer(layer)

    def get_finished(self):
        sent, received = super().get_finished()
        self.failed.extend(f"{f.request_id}: {f.error}" for f in sent if f.error)
        return sent, received


def _send_all(sender: KVSender, req: SendRequest, num_layers: int) -> None:
    sender.begin_batch([req])
    for layer in range(num_layers):
        sender.save_layer(layer)


def _wait_done(sender: KVSender, rid: str) -> float:
    """perf_counter() when D acknowledged the request's KV."""
    while True:
        st = sender.status(rid)
        if st.state.finished:
            break
        time.sleep(0.0001)
    t = time.perf_counter()
    sender.pop_finished()
    if st.state is not TransferState.DONE:
        raise RuntimeError(f"transfer {rid} failed: {st.error}")
    return t


def bench_shape(shape: str, args: argparse.Namespace) -> dict:
    spec, store = _spec(shape, args.block_size), PairStoreHost()
    row = _bench(_SimulatedPrefill(spec, args.tokens, args.layer_ms, _config(args, store)), args, store)
    return {"shape": shape, "compute": f"simulated {args.layer_ms} ms/layer", **row}


def bench_engine(args: argparse.Namespace) -> dict:
    store = PairStoreHost()
    prefill = _EnginePrefill(args.engine, args.tokens, args.block_size, args.image_px, _config(args, store))
    row = _bench(prefill, args, store)
    return {"shape": f"engine:{Path(args.engine).name}", "compute": "real engine (EP role)", **row}


def _config(args: argparse.Namespace, store: PairStoreHost) -> KVTransferConfig:
    """The prefill side's: `store` is its pair store, in process."""
    return KVTransferConfig(timeout_s=args.timeout_s, bootstrap_timeout_s=600.0, connect_timeout_s=60.0,
                            network=PairNetwork(store=store))


def _bench(prefill, args: argparse.Namespace, store: PairStoreHost) -> dict:
    spec, tokens = prefill.spec, prefill.tokens
    nblocks = -(-tokens // spec.block_size)
    kv_bytes = spec.bytes_per_block() * nblocks
    rounds = args.warmup + args.repeats
    # Modes alternate which goes first; D receives into two block sets in turn, so it can
    # hash one request while the next one lands.
    order = [(m, f"{m}-{i}") for i in range(rounds) for m in (MODES if i % 2 == 0 else MODES[::-1])]
    dst = [tuple(range((k % 2) * nblocks, (k % 2 + 1) * nblocks)) for k in range(len(order))]
    cfg = _config(args, store)
    cpu = get_platform("cpu")
    server = RendezvousServer(store=store)
    sender = prefill.sender
    peer_cfg = dict(spec=[spec.num_layers, spec.num_kv_heads, spec.head_dim, spec.block_size, str(spec.dtype)[6:]],
                    num_blocks=nblocks, tokens=tokens,
                    kv=server.rendezvous("bench-kv").for_peer().to_json(),
                    raw=server.rendezvous("bench-raw").for_peer().to_json(),
                    raw_bytes=kv_bytes, raw_rounds=rounds, requests=[[rid, list(d)] for (_, rid), d in zip(order, dst)],
                    timeout_s=args.timeout_s)
    # the peer lingers until its stdin closes (communicate() below): it must not close the pair
    # before P has D's acknowledgement of the last round
    peer = subprocess.Popen([sys.executable, "-m", "epdserve.bench.kv_transfer", "--peer", json.dumps(peer_cfg)],
                            stdout=subprocess.PIPE, stdin=subprocess.PIPE, text=True)
    raw_pair = PairConnection(server.rendezvous("bench-raw"), cpu, cfg)
    try:
        kv_pair = sender.connect("d0", server.rendezvous("bench-kv"))
        if not (raw_pair.wait_ready(60) and kv_pair.wait_ready(60)):
            raise RuntimeError(f"decode peer did not connect: {raw_pair.error or kv_pair.error}")
        raw = _raw_rounds(raw_pair, kv_bytes, rounds)[args.warmup:]
        times: dict[str, list[tuple[float, float]]] = {m: [] for m in MODES}
        digests = {}
        for (mode, rid), d in zip(order, dst):
            pre, tail, digests[rid] = prefill.round(sender, rid, d, layerwise=mode == "layerwise")
            times[mode].append((pre, tail))
        out, _ = peer.communicate(timeout=60)
        peer_digests = json.loads(out.strip().splitlines()[-1])["digests"]
    finally:
        raw_pair.close()
        prefill.close()
        if peer.poll() is None:
            peer.kill()
            peer.wait(10)
        server.close()
    bad = [rid for rid in digests if peer_digests.get(rid) != digests[rid]]
    if bad:
        raise RuntimeError(f"decode peer's KV differs from the prefill's for {bad}")
    timed = {m: times[m][args.warmup:] for m in MODES}
    tail = {m: statistics.median(t for _, t in timed[m]) for m in MODES}
    pre = {m: statistics.median(p for p, _ in timed[m]) for m in MODES}
    e2e = {m: statistics.median(p + t for p, t in timed[m]) for m in MODES}
    raw_s = statistics.median(raw)
    return {
        "layers": spec.num_layers, "kv_heads": spec.num_kv_heads, "head_dim": spec.head_dim,
        "dtype": str(spec.dtype)[6:], "tokens": tokens, "kv_bytes": kv_bytes, "repeats": args.repeats,
        "raw_ms": raw_s * 1e3, "raw_MBps": kv_bytes / raw_s / 1e6,
        "after_tail_ms": tail["after"] * 1e3, "after_MBps": kv_bytes / tail["after"] / 1e6,
        "layerwise_tail_ms": tail["layerwise"] * 1e3,
        "hidden_pct": 100.0 * (1.0 - tail["layerwise"] / tail["after"]),
        "prefill_ms_after": pre["after"] * 1e3, "prefill_ms_layerwise": pre["layerwise"] * 1e3,
        "e2e_ms_after": e2e["after"] * 1e3, "e2e_ms_layerwise": e2e["layerwise"] * 1e3,
        "bit_exact": True,
    }


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
    head = (f"{'shape':<24} {'tokens':>6} {'KV MB':>6} {'raw ms':>7} {'raw MB/s':>8} {'after tail':>10} "
            f"{'after MB/s':>10} {'layerwise tail':>14} {'hidden':>7} {'prefill ms after/lw':>20} "
            f"{'prefill->D ready after/lw':>26}")
    lines = [head, "-" * len(head)]
    for r in rows:
        lines.append(
            f"{r['shape']:<24} {r['tokens']:>6} {r['kv_bytes'] / 1e6:>6.2f} {r['raw_ms']:>7.2f} {r['raw_MBps']:>8.0f} "
            f"{r['after_tail_ms']:>8.2f}ms {r['after_MBps']:>10.0f} {r['layerwise_tail_ms']:>12.2f}ms "
            f"{r['hidden_pct']:>6.1f}% {r['prefill_ms_after']:>9.1f} /{r['prefill_ms_layerwise']:>8.1f} "
            f"{r['e2e_ms_after']:>14.1f} /{r['e2e_ms_layerwise']:>9.1f}")
    lines.append("compute: " + "; ".join(f"{r['shape']}: {r['compute']}" for r in rows))
    return "\n".join(lines)


# ---------------------------------------------------------------------------- decode side (subprocess)
def _decode_peer(cfg: dict) -> int:
    torch.set_num_threads(1)
    layers, heads, dim, block_size, dtype = cfg["spec"]
    spec = KVCacheSpec(layers, heads, dim, block_size, getattr(torch, dtype))
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
        sys.stdin.read()  # D marks a batch DONE before it acknowledges it: stay until P has every ack
        return 0
    finally:
        rx.close()
        raw.close()


if __name__ == "__main__":
    sys.exit(main())
