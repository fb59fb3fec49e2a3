"""KV bytes per turn of a multi-turn conversation over the P→D hop, with D's prefix cache on
and off: D keeps the KV it imported (and decoded), so turn N+1 moves only
the blocks D lacks.

`PDPair` is a prefill-only and a decode-only engine in one process over one real gloo pair on
loopback (the layerwise connectors, as in an instance), with D's reservation handed to P the
way the `Decode`/`Prefill` RPCs do (`num_cached_tokens`). `main` runs one conversation — an
image, then each turn appending the answer and a new question — through it twice, D's cache
on then off, and prints per turn: prompt tokens, tokens D held already, KV bytes sent, and the
saving against the cache-off run (whose tokens must be the same).

    python benchmarks/kv_prefix_reuse_bench.py [--model DIR] [--turns 4] [--max-tokens 16]
"""
from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path

from epdserve.engine.config import EngineConfig
from epdserve.engine.engine_request import EngineRequest
from epdserve.engine.llm_engine import LLMEngine
from epdserve.engine.prefix_hash import media_extra
from epdserve.engine.sampling_params import SamplingParams
from epdserve.seams.kv_connector import RemoteDecode, RemotePrefill
from epdserve.transfer.kv import KVTransferConfig, LayerwiseRecvConnector, LayerwiseSendConnector, RendezvousServer

PH = "<|vision_start|><|image_pad|><|vision_end|>"
CFG = KVTransferConfig(timeout_s=20.0, bootstrap_timeout_s=20.0, connect_timeout_s=20.0)


def step_until(cond, engines, timeout_s: float = 60.0) -> list:
    """Step `engines` until `cond(outputs so far)`; the outputs."""
    outs, deadline = [], time.monotonic() + timeout_s
    while not cond(outs):
        if time.monotonic() > deadline:
            raise TimeoutError("the P-D pair made no progress")
        for e in engines:
            outs.extend(e.step())
        time.sleep(0.001)
    return outs


class PDPair:
    """A P engine and a D engine (sharing the loaded model) over one gloo pair."""

    def __init__(self, model_dir, d_cache: bool = True, d_kv_bytes: int | None = None):
        self.tx, self.rx = LayerwiseSendConnector(CFG), LayerwiseRecvConnector("d0", CFG)
        self.p = LLMEngine(EngineConfig(model=str(model_dir), device="cpu", roles="EP"), kv_connector=self.tx)
        d_cfg = EngineConfig(model=str(model_dir), device="cpu", roles="D", enable_prefix_caching=d_cache)
        if d_kv_bytes is not None:
            d_cfg.kv_cache_memory_bytes = d_kv_bytes
        self.d = LLMEngine(d_cfg, model=self.p.model, kv_connector=self.rx)
        self.server = RendezvousServer()
        self.tx.join("d0", self.rx.pair_for("p0", self.server.host, self.server.port).for_peer())
        step_until(lambda _: self.tx.pair_state("d0").value == "ready", [])

    @property
    def block_bytes(self) -> int:
        return self.p.kv_cache.spec.bytes_per_block()

    def turn(self, rid: str, prompt: str, images: list[bytes], params: SamplingParams, identity: bool = True):
        """One request through P then D: (D's final output, prompt tokens D held already, KV
        bytes P sent for it). `identity=False`: D is not told the media's identity."""
        req = self.p.build_request(rid, prompt, images, params)
        ids = tuple((m.key, media_extra(m.grid_thw.reshape(-1).tolist()), m.num_tokens) for m in req.media)
        self.d.add_request(EngineRequest(rid, req.prompt_token_ids, [], params, kv_transfer=RemotePrefill("p0"),
                                         media_identity=ids if identity else ()))
        cached = self.rx.cached_tokens(rid)
        req.kv_transfer = RemoteDecode("d0", self.rx.reserved_blocks(rid), cached)
        before = self.tx.counters.bytes
        self.p.add_request(req)
        (first,) = step_until(lambda o: o, [self.p])
        if first.error is not None:
            raise RuntimeError(first.error)
        self.rx.set_first_token(rid, first.token_ids[0], first.rope_delta)
        outs = step_until(lambda o: any(x.finished for x in o), [self.d])
        step_until(lambda _: not self.p.has_pending_transfers(), [self.p])
        if outs[-1].error is not None:
            raise RuntimeError(outs[-1].error)
        return outs[-1], cached, self.tx.counters.bytes - before

    def close(self) -> None:
        self.tx.close()
        self.rx.close()
        self.server.close()


def conversation(pair: PDPair, turns: int, image: bytes, params: SamplingParams) -> list[dict]:
    """Run one conversation; per turn: prompt tokens, cached tokens, bytes sent, output tokens."""
    prompt, rows = f"system: you are a helpful assistant; describe images carefully. user: look at {PH}. ", []
    for t in range(turns):
        out, cached, sent = pair.turn(f"turn{t}", prompt, [image], params)
        rows.append(dict(turn=t + 1, prompt_tokens=out.num_prompt_tokens, cached_tokens=cached, bytes=sent,
                         token_ids=list(out.token_ids)))
        prompt += pair.p.tokenizer.decode(out.token_ids) + f" user: question {t + 2}, tell me more. "
    return rows


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", help="model directory (default: the tiny demo Qwen2.5-VL, built in a temp dir)")
    ap.add_argument("--turns", type=int, default=4)
    ap.add_argument("--max-tokens", type=int, default=16)
    a = ap.parse_args(argv)
    from epdserve.model.demo import build_demo_model
    from epdserve.model.demo_images import jpeg_bytes, procedural_image

    with tempfile.TemporaryDirectory() as tmp:
        model = a.model or build_demo_model(Path(tmp), arch="qwen2_5_vl", size="tiny", seed=0)
        image, params = jpeg_bytes(procedural_image(224, 168, 5)), SamplingParams(max_tokens=a.max_tokens, ignore_eos=True)
        runs = {}
        for d_cache in (True, False):
            pair = PDPair(model, d_cache=d_cache)
            try:
                runs[d_cache] = conversation(pair, a.turns, image, params)
            finally:
                pair.close()
    on, off = runs[True], runs[False]
    print(f"KV bytes per turn over the P->D hop (block {pair.p.kv_cache.spec.block_size} tokens, "
          f"{pair.block_bytes} bytes per block)")
    print("| turn | prompt tokens | D cached | bytes, D cache on | bytes, off | saved |")
    print("|---|---|---|---|---|---|")
    for r, s in zip(on, off):
        print(f"| {r['turn']} | {r['prompt_tokens']} | {r['cached_tokens']} | {r['bytes']} | {s['bytes']} | "
              f"{1 - r['bytes'] / s['bytes']:.0%} |")
    later_on, later_off = sum(r["bytes"] for r in on[1:]), sum(s["bytes"] for s in off[1:])
    if later_off:
        print(f"turns >= 2: {later_on} vs {later_off} bytes, {1 - later_on / later_off:.0%} fewer with D's cache")
    same = all(r["token_ids"] == s["token_ids"] for r, s in zip(on, off))
    print("outputs identical with D's cache on and off:", same)
    return 0 if same else 1
