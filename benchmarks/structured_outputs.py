"""Structured outputs, measured: (1) schema validity of 200 requests (a JSON schema with nested
objects and enums, half of them with an image) through the OpenAI HTTP front of real
deployments (`epdserve launch`, each mode given), checked with `jsonschema`; (2) the grammar's
cost to decode throughput at batch 32 on the offline engine, with and without a grammar,
alternated round by round (the machine's speed drifts; pairs cancel it); (3) the compile time
of the schema (first use) and of a cached one.

    python benchmarks/structured_outputs.py --model DIR [--modes monolithic,P-D] [--requests 200]
        [--batch 32] [--tokens 64] [--rounds 5]

DIR: a checkpoint (`epdserve demo-model --out DIR` makes a random-weight one). Throughput uses
a schema whose one field is a free string ({"text": string}): every output runs to --tokens
(ignore_eos), so both arms decode the same tokens and only the mask differs. Prints one JSON
line per part.
"""
from __future__ import annotations

import argparse
import base64
import json
import os
import re
import statistics
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]

SCHEMA = {
    "type": "object",
    "properties": {
        "kind": {"enum": ["cat", "dog", "car", "tree"]},
        "box": {"type": "object", "properties": {"w": {"enum": [1, 2, 3]}, "unit": {"enum": ["px", "cm"]}},
                "required": ["w", "unit"], "additionalProperties": False},
        "tags": {"type": "object", "properties": {"indoor": {"type": "boolean"}, "color": {"enum": ["red", "blue"]}},
                 "required": ["indoor", "color"], "additionalProperties": False},
    },
    "required": ["kind", "box", "tags"],
    "additionalProperties": False,
}
FREE_TEXT = {"type": "object", "properties": {"text": {"type": "string"}}, "required": ["text"]}
READY = re.compile(r"^epdserve ready: grpc://\S+ .* http=(?P<http>http://\S+)")


def validity(model: str, mode: str, n: int, max_tokens: int) -> dict:
    import jsonschema
    import openai

    from epdserve.deploy.launcher_process import LauncherProcess, launch_argv
    from epdserve.model.demo_images import jpeg_bytes, procedural_image

    argv = launch_argv("--config", str(REPO / "configs" / f"{mode}.yaml"), "--model", model, "--kv-cache-mb", "64",
                       "--http-port", "0", "--served-model-name", "m")
    env = {k: v for k, v in os.environ.items() if not k.startswith("EPDSERVE_")}
    lp = LauncherProcess(argv, env=env, ready=READY)
    try:
        m = lp.wait_ready(600)
        if m is None:
            raise SystemExit("launch never got ready:\n" + lp.tail(40))
        oai = openai.OpenAI(base_url=m.group("http") + "/v1", api_key="none", max_retries=0, timeout=600)
        fmt = {"type": "json_schema", "json_schema": {"name": "thing", "schema": SCHEMA, "strict": True}}

        def one(i: int):
            content = [{"type": "text", "text": f"Request {i}: describe what you see as JSON."}]
            if i % 2:
                jpeg = jpeg_bytes(procedural_image(64 + 8 * (i % 4), 64, seed=i))
                content.insert(0, {"type": "image_url",
                                   "image_url": {"url": "data:image/jpeg;base64," + base64.b64encode(jpeg).decode()}})
            r = oai.chat.completions.create(model="m", messages=[{"role": "user", "content": content}],
                                            max_tokens=max_tokens, temperature=1.0, seed=i, response_format=fmt)
            c = r.choices[0]
            try:
                jsonschema.validate(json.loads(c.message.content), SCHEMA)
                return c.finish_reason, True
            except (ValueError, jsonschema.ValidationError):
                return c.finish_reason, False

        t0 = time.perf_counter()
        with ThreadPoolExecutor(8) as pool:
            results = list(pool.map(one, range(n)))
        wall = time.perf_counter() - t0
    finally:
        lp.terminate(120)
    reasons = {r: sum(1 for x, _ in results if x == r) for r in {x for x, _ in results}}
    return {"part": "validity", "mode": mode, "requests": n, "with_image": n // 2,
            "schema_valid": sum(ok for _, ok in results), "finish_reasons": reasons, "wall_s": round(wall, 1)}


def throughput(model: str, batch: int, tokens: int, rounds: int) -> dict:
    from epdserve import LLM, SamplingParams
    from epdserve.engine.structured_output import StructuredOutput

    llm = LLM(model=model, device="cpu")
    grammar = StructuredOutput("json", json.dumps(FREE_TEXT))
    prompts = [f"Write note number {i} about the weather" for i in range(batch)]

    def run(structured) -> float:
        p = SamplingParams(max_tokens=tokens, ignore_eos=True, structured=structured)
        llm.generate(prompts[:2], SamplingParams(max_tokens=2, structured=structured))  # warm (and compile)
        t0 = time.perf_counter()
        outs = llm.generate(prompts, p)
        dt = time.perf_counter() - t0
        assert all(len(o.outputs[0].token_ids) == tokens for o in outs)
        return batch * tokens / dt

    plain, masked = [], []
    for _ in range(rounds):
        plain.append(run(None))
        masked.append(run(grammar))
    ratios = [m / p for p, m in zip(plain, masked)]
    return {"part": "throughput", "batch": batch, "tokens": tokens, "rounds": rounds,
            "plain_tok_s": round(statistics.median(plain), 1), "plain_range": [round(min(plain), 1), round(max(plain), 1)],
            "grammar_tok_s": round(statistics.median(masked), 1),
            "grammar_range": [round(min(masked), 1), round(max(masked), 1)],
            "grammar_over_plain": round(statistics.median(ratios), 3),
            "ratio_range": [round(min(ratios), 3), round(max(ratios), 3)],
            "note": "tok/s = batch * tokens / wall time of generate (prefill included, same in both arms)"}


def compile_cost(model: str, repeats: int = 5) -> dict:
    from epdserve import LLM
    from epdserve.engine.structured_output import StructuredOutput

    backend = LLM(model=model, device="cpu").engine.grammars
    first, cached = [], []
    for i in range(repeats):  # a new schema each time (a different enum value): a real compile
        schema = dict(SCHEMA, properties=dict(SCHEMA["properties"], kind={"enum": ["cat", f"thing{i}"]}))
        c = StructuredOutput("json", json.dumps(schema))
        t0 = time.perf_counter()
        backend.matcher(c)
        t1 = time.perf_counter()
        backend.matcher(c)
        first.append((t1 - t0) * 1e3)
        cached.append((time.perf_counter() - t1) * 1e3)
    return {"part": "compile", "vocab": backend.vocab_size, "repeats": repeats,
            "first_ms": round(statistics.median(first), 2), "first_range": [round(min(first), 2), round(max(first), 2)],
            "cached_ms": round(statistics.median(cached), 3),
            "cached_range": [round(min(cached), 3), round(max(cached), 3)],
            "note": "a new schema each repeat; the first repeat also builds xgrammar's TokenizerInfo"}


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", required=True, help="checkpoint directory")
    ap.add_argument("--modes", default="monolithic,P-D", help="deployment modes for the validity run (comma list; '' skips it)")
    ap.add_argument("--requests", type=int, default=200)
    ap.add_argument("--max-tokens", type=int, default=300, help="per request of the validity run")
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--tokens", type=int, default=64, help="output tokens per request of the throughput run")
    ap.add_argument("--rounds", type=int, default=5, help="throughput: with/without pairs")
    ap.add_argument("--skip-throughput", action="store_true")
    args = ap.parse_args()
    print(json.dumps(compile_cost(args.model)), flush=True)
    if not args.skip_throughput:
        print(json.dumps(throughput(args.model, args.batch, args.tokens, args.rounds)), flush=True)
    for mode in filter(None, args.modes.split(",")):
        print(json.dumps(validity(args.model, mode, args.requests, args.max_tokens)), flush=True)


if __name__ == "__main__":
    main()
