"""The KV hop between tensor-parallel degrees on this CPU (issue 48's figures).

    python benchmarks/kv_degrees.py [--tokens 300] [--repeats 5] [--model DIR] [--out FILE]

1. Bytes: for every (P degree m, D degree n) in {1, 2, 4}², a Qwen2.5-VL-7B-shaped KV (28 layers,
   4 KV heads of 128, bf16, blocks of 16) of one `--tokens`-token request crosses one pair of m + n
   ranks (gloo on loopback; threads of this process stand for the ranks' processes): the KV bytes all
   P ranks sent against the ideal (the bytes of the heads D's ranks hold, a replicated head once
   per rank holding it), checked bit for bit on every D rank, and the time from the batch's opening to
   D's DONE (median and range over `--repeats`).
2. TTFT (with `--model`, a demo checkpoint: `epdserve demo-model --size small DIR`): a prefill
   engine at TP1 and at TP2 sending to a decode engine at TP1, one request with a 224 px image
   at a time: the first token (P's) and the first token D decoded after the KV arrived, median and
   range over `--repeats`, both configurations measured in this run.
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time

import torch

from epdserve.engine.kv_cache import KVCacheSpec, PagedKVCache
from epdserve.kv_layout import KvShare, rank_kv_heads
from epdserve.platform import get_platform
from epdserve.transfer.kv import KVReceiver, KVSender, KVTransferConfig, RecvRequest, RendezvousServer, SendRequest
from epdserve.transfer.kv.links import held_heads

LAYERS, KVH, HEAD_DIM, BLOCK = 28, 4, 128, 16
CFG = KVTransferConfig(timeout_s=60.0, bootstrap_timeout_s=60.0, connect_timeout_s=60.0)


def _spec(heads: int) -> KVCacheSpec:
    return KVCacheSpec(LAYERS, heads, HEAD_DIM, BLOCK, torch.bfloat16)


def _wait(side, rid: str):
    while True:
        for st in side.pop_finished():
            if st.request_id == rid:
                return st
        time.sleep(0.0005)


def hop_bytes(m: int, n: int, tokens: int, repeats: int, kvh: int = KVH) -> dict:
    cpu, server = get_platform("cpu"), RendezvousServer()
    blocks = -(-tokens // BLOCK)
    p_caches = [PagedKVCache(_spec(len(rank_kv_heads(kvh, m, r))), blocks) for r in range(m)]
    d_caches = [PagedKVCache(_spec(len(rank_kv_heads(kvh, n, s))), blocks) for s in range(n)]
    txs = [KVSender(c, cpu, CFG, KvShare(kvh, m, r)) for r, c in enumerate(p_caches)]
    rxs = [KVReceiver(c, cpu, CFG, KvShare(kvh, n, s)) for s, c in enumerate(d_caches)]
    try:
        base = server.rendezvous(f"bench-{m}-{n}")
        rdzv = type(base)(base.host, base.port, base.pair_name, 0, m, n)
        pairs = [tx.connect("d", rdzv.for_rank(r)) for r, tx in enumerate(txs)]
        pairs += [rx.connect("p", rdzv.for_rank(m + s)) for s, rx in enumerate(rxs)]
        assert all(p.wait_ready(60) for p in pairs), [p.error for p in pairs]
        ids = tuple(range(blocks))
        g = torch.Generator().manual_seed(0)
        model_k = [torch.randn(blocks, BLOCK, kvh, HEAD_DIM, generator=g).bfloat16() for _ in range(LAYERS)]
        for layer in range(LAYERS):
            for r, c in enumerate(p_caches):
                h = rank_kv_heads(kvh, m, r)
                c.write_blocks(layer, list(ids), model_k[layer][:, :, h.start:h.stop], -model_k[layer][:, :, h.start:h.stop])
        times, sent = [], 0
        for i in range(repeats):
            before = sum(tx.bytes_sent for tx in txs)
            rid = f"r{i}"
            rxs[0].expect(RecvRequest(rid, "p", ids, tokens))
            t0 = time.perf_counter()
            opened = txs[0].begin_batch([SendRequest(rid, "d", ids, ids, tokens)])
            for tx in txs[1:]:
                tx.follow(opened)
            for layer in range(LAYERS):
                for tx in txs:
                    tx.save_layer(layer)
            st = _wait(rxs[0], rid)
            times.append((time.perf_counter() - t0) * 1e3)
            assert st.error is None, st.error
            _wait(txs[0], rid)
            sent = sum(tx.bytes_sent for tx in txs) - before
        for s, c in enumerate(d_caches):  # every D rank holds exactly its heads of the model's KV
            h = rank_kv_heads(kvh, n, s)
            for layer in range(LAYERS):
                k, v = c.read_blocks(layer, list(ids))
                assert torch.equal(k, model_k[layer][:, :, h.start:h.stop]) and torch.equal(v, -model_k[layer][:, :, h.start:h.stop])
        ideal = blocks * 2 * LAYERS * BLOCK * HEAD_DIM * 2 * held_heads(kvh, n)
        return {"sent": sent, "ideal": ideal, "ms": _spread(times)}
    finally:
        for e in txs + rxs:
            e.close()
        server.close()


def _spread(xs: list[float]) -> str:
    return f"{statistics.median(xs):.1f} ({min(xs):.1f}–{max(xs):.1f})"


def ttft(model: str, p_tp: int, repeats: int) -> dict:
    from epdserve import SamplingParams
    from epdserve.engine.config import EngineConfig
    from epdserve.engine.engine_request import EngineRequest
    from epdserve.engine.llm_engine import LLMEngine
    from epdserve.model.demo_images import jpeg_bytes, procedural_image
    from epdserve.seams.kv_connector import RemoteDecode, RemotePrefill
    from epdserve.transfer.kv import LayerwiseRecvConnector, LayerwiseSendConnector

    tx, rx, server = LayerwiseSendConnector(CFG), LayerwiseRecvConnector("d0", CFG), RendezvousServer()
    engines = []
    try:
        p_eng = LLMEngine(EngineConfig(model=model, device="cpu", roles="EP", tensor_parallel_size=p_tp), kv_connector=tx)
        engines.append(p_eng)
        d_eng = LLMEngine(EngineConfig(model=model, device="cpu", roles="D"), kv_connector=rx)
        engines.append(d_eng)
        img = jpeg_bytes(procedural_image(224, 224, 3))
        sp = SamplingParams(max_tokens=2, ignore_eos=True)
        firsts, decoded = [], []
        for i in range(repeats + 1):  # the first is a warm-up
            rid = f"t{i}"
            req = p_eng.build_request(rid, f"<|vision_start|><|image_pad|><|vision_end|>describe it, take {i}", [img], sp)
            tx.join("d0", rx.pair_for("p0", server.host, server.port, p_tp).for_peer())
            d_eng.add_request(EngineRequest(rid, req.prompt_token_ids, [], sp, kv_transfer=RemotePrefill("p0")))
            req.kv_transfer = RemoteDecode("d0", rx.reserved_blocks(rid))
            while tx.pair_state("d0").value != "ready":
                time.sleep(0.001)
            t0 = time.perf_counter()
            p_eng.add_request(req)
            first = None
            while first is None:
                outs = p_eng.step()
                first = outs[0] if outs else None
            t_first = time.perf_counter()
            rx.set_first_token(rid, first.token_ids[0], first.rope_delta)
            done = False
            while not done:
                done = any(o.finished for o in d_eng.step())
                p_eng.step()
            if i:
                firsts.append((t_first - t0) * 1e3)
                decoded.append((time.perf_counter() - t0) * 1e3)
            while p_eng.has_pending_transfers():
                p_eng.step()
        return {"first_ms": _spread(firsts), "d_done_ms": _spread(decoded)}
    finally:
        for e in engines:
            e.close()
        tx.close()
        rx.close()
        server.close()


def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tokens", type=int, default=300)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--kv-heads", type=int, default=KVH, help="the model's KV heads (2: a TP4 side holds each on two ranks)")
    ap.add_argument("--model", help="a demo checkpoint for the TTFT part (skipped without it)")
    ap.add_argument("--out", help="also write the Markdown here")
    a = ap.parse_args(argv)
    lines = [f"KV of one {a.tokens}-token request, Qwen2.5-VL-7B shape ({LAYERS} layers, {a.kv_heads} KV heads x {HEAD_DIM}, "
             f"bf16), P TPm -> D TPn over gloo on loopback, {a.repeats} repeats", "",
             "| P TP | D TP | KV bytes sent (all P ranks) | ideal (D heads' bytes) | sent / ideal | open -> D DONE, ms (range) |",
             "|---:|---:|---:|---:|---:|---:|"]
    for m in (1, 2, 4):
        for n in (1, 2, 4):
            r = hop_bytes(m, n, a.tokens, a.repeats, a.kv_heads)
            lines.append(f"| {m} | {n} | {r['sent']:,} | {r['ideal']:,} | {r['sent'] / r['ideal']:.3f} | {r['ms']} |")
            print(lines[-1], flush=True)
    if a.model:
        lines += ["", f"one request with a 224 px image, P -> D TP1 engines, {a.repeats} repeats after a warm-up", "",
                  "| P TP | first token (P's), ms | D's first decoded token, ms |", "|---:|---:|---:|"]
        for p_tp in (1, 2):
            r = ttft(a.model, p_tp, a.repeats)
            lines.append(f"| {p_tp} | {r['first_ms']} | {r['d_done_ms']} |")
            print(lines[-1], flush=True)
    text = "\n".join(lines) + "\n"
    print(text)
    if a.out:
        with open(a.out, "w") as f:
            f.write(text)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
