"""What unforgeable identities cost (keyed media keys, SHA-256 block keys): a 1-image request's TTFT, the media key, and the
prefix-cache lookup of a long cached prompt, through the offline engine's own code paths.

Written against the engine's API as it was before those keys as well (`build_request`, `media_item`,
the scheduler's `hasher.hashes` and the block manager's `lookup`), so one run of this script per
tree, alternated, compares old and new on the same machine (docs/measurements.md has the
figures and the command). Prints one JSON line of medians.

    python benchmarks/identity_cost.py [--model DIR] [--requests 12] [--lookups 300] [--image-px 448]
"""
from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path

from epdserve.engine.config import EngineConfig
from epdserve.engine.llm_engine import LLMEngine
from epdserve.engine.sampling_params import SamplingParams
from epdserve.engine.sequence import Sequence
from epdserve.model.demo_images import jpeg_bytes, procedural_image

PH = "<|vision_start|><|image_pad|><|vision_end|>"


def ttft_ms(eng: LLMEngine, rid: str, prompt: str, image: bytes) -> float:
    """From the raw request (image bytes: decoded, keyed, encoded) to its first token."""
    t0 = time.perf_counter()
    eng.add_request(eng.build_request(rid, prompt, [image], SamplingParams(max_tokens=1, ignore_eos=True)))
    while True:
        for out in eng.step():
            if out.request_id == rid and out.token_ids:
                t = (time.perf_counter() - t0) * 1e3
                while eng.has_unfinished():
                    eng.step()
                return t


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", help="model directory (default: the tiny demo Qwen2-VL, built in a temp dir)")
    ap.add_argument("--requests", type=int, default=12, help="1-image requests timed (after 2 warm-ups)")
    ap.add_argument("--lookups", type=int, default=300, help="prefix-cache lookups timed")
    ap.add_argument("--image-px", type=int, default=448, help="the images' width and height")
    ap.add_argument("--prompt-tokens", type=int, default=4096, help="about how long the looked-up prompt is")
    a = ap.parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        from epdserve.model.demo import build_demo_model

        model = a.model or build_demo_model(Path(tmp), arch="qwen2_vl", size="tiny", seed=0)
        eng = LLMEngine(EngineConfig(model=str(model), device="cpu", step_budget=False,
                                     kv_cache_memory_bytes=256 << 20))
        images = [jpeg_bytes(procedural_image(a.image_px, a.image_px, seed)) for seed in range(a.requests + 2)]
        prompt = f"Describe {PH} in detail."
        ttft = [ttft_ms(eng, f"r{i}", prompt, img) for i, img in enumerate(images)][2:]  # new images: no reuse

        media = eng.processor.process(prompt, [images[0]]).media[0]
        key_us = []
        for _ in range(200):
            t0 = time.perf_counter()
            eng.media_item(media)
            key_us.append((time.perf_counter() - t0) * 1e6)

        sentence = "the quick brown fox jumps over the lazy dog "  # about a token a character (the demo tokenizer)
        long_prompt = f"Look at {PH}. " + sentence * max(1, a.prompt_tokens // len(sentence))
        req = eng.build_request("long", long_prompt, [images[0]], SamplingParams(max_tokens=1, ignore_eos=True))
        eng.add_request(req)
        while eng.has_unfinished():
            eng.step()  # its blocks are in the prefix cache now
        sched = eng.scheduler
        lookup_us, hit = [], 0
        for i in range(a.lookups):
            seq = Sequence(f"q{i}", list(req.prompt_token_ids), req.params, media=list(req.media))
            t0 = time.perf_counter()
            hit = len(sched._blocks.lookup(sched.hasher.hashes(seq, seq.num_tokens)))
            lookup_us.append((time.perf_counter() - t0) * 1e6)
    print(json.dumps({
        "ttft_ms": round(statistics.median(ttft), 3), "media_key_us": round(statistics.median(key_us), 2),
        "lookup_us": round(statistics.median(lookup_us), 1), "lookup_blocks_hit": hit,
        "prompt_tokens": len(req.prompt_token_ids), "image_bytes": len(images[0]),
    }))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
