"""Structured outputs, measured: (1) schema validity of 200 requests (a JSON schema with nested
objects and enums, half of them with an image) through the OpenAI HTTP front of real
deployments (`epdserve launch`, each mode given), checked with `jsonschema`; (2) the grammar's
cost to decode throughput at batch 32 on the offline engine, with and without a grammar,
alternated round by round (the machine's speed drifts; pairs cancel it), per wall second and per
CPU second; (3) the grammar's own work per decode step at batch 32 (no model: sync, fill, apply
on random logits, each timed); (4) the compile time of a new schema, of a cached one and of a
big one, and how much of the engine thread's loop survives a compile on the engine's pool.

    OMP_WAIT_POLICY=PASSIVE python benchmarks/structured_outputs.py --model DIR [--modes monolithic,P-D]
        [--requests 200] [--batch 32] [--tokens 64] [--rounds 5]

DIR: a checkpoint (`epdserve demo-model --out DIR` makes a random-weight one). Throughput uses
a schema whose one field is a free string ({"text": string}): every output runs to --tokens
(ignore_eos), so both arms decode the same tokens and only the mask differs. Prints one JSON
line per part. On a shared CPU machine run it with OMP_WAIT_POLICY=PASSIVE: OpenMP's busy-wait
under contention turns the small tensor ops of each step into wall-time noise (seen once, load 16
on 2 cores: the mask step of 32 rows took 0.3-1.0 s of wall time with the default policy, 1-120 ms
with PASSIVE, for about 1 ms of CPU).
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

    from epdserve.deploy.local.launcher_process import LauncherProcess, launch_argv
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

    def run(structured) -> tuple[float, float]:
        p = SamplingParams(max_tokens=tokens, ignore_eos=True, structured=structured)
        llm.generate(prompts[:2], SamplingParams(max_tokens=2, structured=structured))  # warm (and compile)
        t0, c0 = time.perf_counter(), time.process_time()
        outs = llm.generate(prompts, p)
        dt, dc = time.perf_counter() - t0, time.process_time() - c0
        assert all(len(o.outputs[0].token_ids) == tokens for o in outs)
        return batch * tokens / dt, batch * tokens / dc

    plain, masked = [], []
    for _ in range(rounds):
        plain.append(run(None))
        masked.append(run(grammar))

    def stats(i: int, key: str) -> dict:
        a, b = [x[i] for x in plain], [x[i] for x in masked]
        r = [y / x for x, y in zip(a, b)]
        return {f"plain_{key}": round(statistics.median(a), 1), f"plain_{key}_range": [round(min(a), 1), round(max(a), 1)],
                f"grammar_{key}": round(statistics.median(b), 1), f"grammar_{key}_range": [round(min(b), 1), round(max(b), 1)],
                f"grammar_over_plain_{key}": round(statistics.median(r), 3),
                f"ratio_{key}_range": [round(min(r), 3), round(max(r), 3)]}

    return {"part": "throughput", "batch": batch, "tokens": tokens, "rounds": rounds, **stats(0, "tok_s"),
            **stats(1, "tok_per_cpu_s"),
            "note": "tok/s: batch * tokens / wall time of generate (prefill included, same in both arms); "
                    "tok_per_cpu_s: the same over this process's CPU time (steadier on a shared machine)"}


def mask_cost(model: str, batch: int, steps: int = 64, repeats: int = 5) -> dict:
    """The grammar's own work per decode step at `batch` rows, no model, on random logits, split
    as the engine runs it (engine/grammar.py TokenMasker, one per engine): sync (each matcher
    accepts the token sampled last step), fill (xgrammar's batched bitmask fill), apply
    (xgrammar's CPU kernel). The token taken is an alphabetic one where the grammar allows one,
    so each row stays inside FREE_TEXT's string (the state with the most tokens to check)
    instead of closing it early."""
    import torch

    from epdserve import LLM
    from epdserve.engine.grammar import TokenMasker, sync_states
    from epdserve.engine.structured_output import StructuredOutput

    eng = LLM(model=model, device="cpu").engine
    c = StructuredOutput("json", json.dumps(FREE_TEXT))
    vocab = eng.grammars.vocab_size
    gen = torch.Generator().manual_seed(0)
    tok = eng.tokenizer
    wordy = torch.tensor([tok.convert_ids_to_tokens(i).isalpha() if i < len(tok) else False for i in range(vocab)])
    masker = TokenMasker(vocab, "cpu", rows=batch)
    parts = ("sync", "fill", "apply")
    wall: dict[str, list[float]] = {p: [] for p in parts}
    cpu: dict[str, list[float]] = {p: [] for p in parts}
    for _ in range(repeats):
        states = [eng.grammars.matcher(c) for _ in range(batch)]
        outs: list[list[int]] = [[] for _ in range(batch)]
        t = dict.fromkeys(parts, 0.0)
        tc = dict.fromkeys(parts, 0.0)
        for _ in range(steps):
            logits = torch.randn(batch, vocab, generator=gen)
            rows = [(i, s, o) for i, (s, o) in enumerate(zip(states, outs))]
            for part, fn in (("sync", lambda: sync_states(rows)), ("fill", lambda: masker.fill(rows, batch)),
                             ("apply", lambda: masker.apply(logits, rows))):
                t0, c0 = time.perf_counter(), time.process_time()
                fn()
                t[part] += time.perf_counter() - t0
                tc[part] += time.process_time() - c0
            for o, token in zip(outs, (logits + 100.0 * wordy).argmax(-1).tolist()):
                o.append(token)
        for p in parts:
            wall[p].append(t[p] / steps * 1e3)
            cpu[p].append(tc[p] / steps * 1e3)
    total = [sum(wall[p][i] for p in parts) for i in range(repeats)]
    total_cpu = [sum(cpu[p][i] for p in parts) for i in range(repeats)]

    def med(xs):
        return round(statistics.median(xs), 3)

    return {"part": "mask", "batch": batch, "vocab": vocab, "steps": steps, "repeats": repeats,
            "ms_per_step": med(total), "range": [round(min(total), 3), round(max(total), 3)],
            "cpu_ms_per_step": med(total_cpu), "cpu_range": [round(min(total_cpu), 3), round(max(total_cpu), 3)],
            **{f"{p}_ms": med(wall[p]) for p in parts}, **{f"{p}_cpu_ms": med(cpu[p]) for p in parts}}


def big_schema(tag: str, fields: int = 40) -> dict:
    """SCHEMA with `fields` optional enum fields more (a bigger compile); `tag` makes it new."""
    extra = {f"field_{tag}_{i}": {"enum": [f"v{j}" for j in range(12)]} for i in range(fields)}
    return dict(SCHEMA, properties=dict(SCHEMA["properties"], kind={"enum": ["cat", tag]}, **extra))


def compile_cost(model: str, repeats: int = 5) -> dict:
    """A new schema's compile and a cached one's (synchronous, `GrammarBackend.matcher`); then
    whether a compile blocks the engine's thread: a huge new schema compiled on the engine's
    pool (engine/grammar_compile.py) while this thread polls it in a loop; the loop's longest
    stall (a compile that held the GIL throughout would stall it for the compile's whole time)."""
    from epdserve import LLM
    from epdserve.engine.grammar_compile import GrammarCompiles
    from epdserve.engine.structured_output import StructuredOutput

    backend = LLM(model=model, device="cpu").engine.grammars
    first, cached, big = [], [], []
    for i in range(repeats):  # a new schema each time (a different enum value): a real compile
        schema = dict(SCHEMA, properties=dict(SCHEMA["properties"], kind={"enum": ["cat", f"thing{i}"]}))
        c = StructuredOutput("json", json.dumps(schema))
        t0 = time.perf_counter()
        backend.matcher(c)
        t1 = time.perf_counter()
        backend.matcher(c)
        first.append((t1 - t0) * 1e3)
        cached.append((time.perf_counter() - t1) * 1e3)
    compiles, stall, pool_ms = GrammarCompiles(backend), [], []
    for i in range(repeats):
        c = StructuredOutput("json", json.dumps(big_schema(f"big{i}")))
        t0 = time.perf_counter()
        backend.compile_uncached(c)
        big.append((time.perf_counter() - t0) * 1e3)
        # a huge schema on the engine's pool; this thread loops as the engine's would (polling)
        c = StructuredOutput("json", json.dumps(big_schema(f"huge{i}", 400)))
        t0 = last = time.perf_counter()
        state, worst = compiles.start(c), 0.0
        while not state.ready:
            compiles.poll()
            now = time.perf_counter()
            worst, last = max(worst, now - last), now
        pool_ms.append((time.perf_counter() - t0) * 1e3)
        stall.append(worst * 1e3)
    compiles.close()

    def stat(xs, nd=2):
        return round(statistics.median(xs), nd), [round(min(xs), nd), round(max(xs), nd)]

    return {"part": "compile", "vocab": backend.vocab_size, "repeats": repeats,
            "first_ms": stat(first)[0], "first_range": stat(first)[1],
            "cached_ms": stat(cached, 3)[0], "cached_range": stat(cached, 3)[1],
            "big_ms": stat(big)[0], "big_range": stat(big)[1],
            "huge_on_pool_ms": stat(pool_ms)[0], "huge_on_pool_range": stat(pool_ms)[1],
            "loop_longest_stall_ms": stat(stall)[0], "loop_longest_stall_range": stat(stall)[1],
            "note": "a new schema each repeat; the first repeat also builds xgrammar's TokenizerInfo; big: "
                    "SCHEMA + 40 optional enum fields; huge: 400, compiled on the engine's pool while this "
                    "thread polls it in a loop; loop_longest_stall: the longest gap between two of the "
                    "loop's turns meanwhile (a compile holding the GIL would stall it for its whole time)"}


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
    print(json.dumps(mask_cost(args.model, args.batch)), flush=True)
    if not args.skip_throughput:
        print(json.dumps(throughput(args.model, args.batch, args.tokens, args.rounds)), flush=True)
    for mode in filter(None, args.modes.split(",")):
        print(json.dumps(validity(args.model, mode, args.requests, args.max_tokens)), flush=True)


if __name__ == "__main__":
    main()
