"""Decode time per output token of the offline `LLM`, and the bare chain of the model's matmuls.

Uses only the public offline API (`LLM`, `SamplingParams`), so the same file times any commit:
run it from two checkouts (e.g. with `farm-bench` pairing the two commands) to compare them in
one run. TPOT = (time of N new tokens - time of 1 new token) / (N - 1), batch B of distinct text
prompts, greedy, `ignore_eos`; median of --repeats with min and max.

--chain also times the model's LM matmuls alone at the same batch and dtype (per layer: QKV, O,
gate-up, down; then the LM head; random weights of the checkpoint's shapes, `torch.mm`), the
floor the engine's per-token overhead is measured against.

    python benchmarks/decode_tpot.py --model DIR --dtype float32 --batch 1 --tokens 33 --chain
"""
from __future__ import annotations

import argparse
import json
import statistics
import time

import torch


def tpot(llm, batch: int, tokens: int, repeats: int) -> list[float]:
    from epdserve import SamplingParams

    prompts = [f"Tell me a story number {i} about a dragon and a knight" for i in range(batch)]
    sp = lambda n: SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True)  # noqa: E731
    llm.generate(prompts, sp(4))

    def timed(n: int) -> float:
        t = time.perf_counter()
        llm.generate(prompts, sp(n))
        return time.perf_counter() - t

    return [(timed(tokens) - timed(1)) / (tokens - 1) for _ in range(repeats)]


def matmul_chain(config_dir: str, dtype: torch.dtype, batch: int, repeats: int) -> list[float]:
    from transformers import AutoConfig

    tc = AutoConfig.from_pretrained(config_dir).text_config
    d = getattr(tc, "head_dim", None) or tc.hidden_size // tc.num_attention_heads
    h, inter = tc.hidden_size, tc.intermediate_size
    shapes = [(h, (tc.num_attention_heads + 2 * tc.num_key_value_heads) * d), (tc.num_attention_heads * d, h),
              (h, 2 * inter), (inter, h)]
    ws = [[torch.randn(o, i, dtype=dtype).t() for i, o in shapes] for _ in range(tc.num_hidden_layers)]
    head = torch.randn(tc.vocab_size, h, dtype=dtype).t()
    xs = {i: torch.randn(batch, i, dtype=dtype) for i, _ in shapes}

    def once():
        for layer in ws:
            for (i, _), w in zip(shapes, layer):
                torch.mm(xs[i], w)
        torch.mm(xs[h], head)

    once()
    out = []
    for _ in range(repeats):
        t = time.perf_counter()
        for _ in range(10):
            once()
        out.append((time.perf_counter() - t) / 10)
    return out


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", required=True)
    ap.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"))
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--tokens", type=int, default=33)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--chain", action="store_true", help="also time the bare chain of the LM's matmuls")
    args = ap.parse_args()
    from epdserve import LLM

    llm = LLM(args.model, device="cpu", dtype=args.dtype)
    ts = tpot(llm, args.batch, args.tokens, args.repeats)
    res = {"dtype": args.dtype, "batch": args.batch, "tpot_ms": round(statistics.median(ts) * 1e3, 2),
           "tpot_min_ms": round(min(ts) * 1e3, 2), "tpot_max_ms": round(max(ts) * 1e3, 2),
           "tok_s": round(args.batch / statistics.median(ts), 1)}
    if args.chain:
        cs = matmul_chain(args.model, getattr(torch, args.dtype), args.batch, args.repeats)
        res.update(chain_ms=round(statistics.median(cs) * 1e3, 2), chain_min_ms=round(min(cs) * 1e3, 2),
                   chain_max_ms=round(max(cs) * 1e3, 2),
                   tpot_over_chain=round(statistics.median(ts) / statistics.median(cs), 3))
    print(json.dumps(res))


if __name__ == "__main__":
    main()
