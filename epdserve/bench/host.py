"""`epdserve bench host`: the engine's host (Python) time per decode step, short vs long outputs.

One engine per output length in `--output-lens` (the weights loaded once and shared), each with
`--batch-size` text requests decoding together (EOS ignored). Every engine's batch is first
brought to its length — each request holds L output tokens — then the engines take turns, one
step each, for `--window` steps: the lengths are measured in the same seconds, so other work on
the machine weighs on each alike. `EngineStats` give every step's host time — scheduling,
input building, update (detokenizing, stop checks, outputs) — apart from its forward; a
length's sample is the median over its window. The result is the ratio of the longest length's
host time to the shortest's, per repeat (fresh batches each time): the aim is 1 ± 0.10, the
step's Python work not growing with output length.
"""
from __future__ import annotations

import argparse
import json
import pathlib
import random
import statistics
import sys
import time

AIM = 0.10  # |ratio - 1| of host time per decode step, longest vs shortest output
PARTS = ("host_s", "schedule_s", "inputs_s", "update_s", "forward_s")


def add_parser(subparsers) -> argparse.ArgumentParser:
    p = subparsers.add_parser("host", help="host (Python) time per decode step at short vs long outputs",
                              description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", metavar="DIR", help="checkpoint directory (default: the tiny demo model, built once "
                                                  "into a cache dir: host time hardly depends on the model's size)")
    p.add_argument("--arch", choices=("qwen2_vl", "qwen2_5_vl"), default="qwen2_vl")
    p.add_argument("--batch-size", type=int, default=64, help="requests decoding together")
    p.add_argument("--output-lens", type=_int_list, default=[128, 2000], metavar="L1,L2,...",
                   help="output lengths to sample host time at (default 128,2000)")
    p.add_argument("--window", type=int, default=32, help="measured decode steps per length and repeat")
    p.add_argument("--prompt-len", type=int, default=64, help="prompt tokens per request")
    p.add_argument("--repeats", type=int, default=3, help="fresh batches, one after another")
    p.add_argument("--threads", type=int, default=2, help="torch threads")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--engine-arg", action="append", default=[], metavar="KEY=VALUE",
                   help="extra EngineConfig field of every engine, e.g. ops=portable (repeatable)")
    p.add_argument("--out", default="bench-host.json", help="JSON report path (default: bench-host.json)")
    p.set_defaults(func=run)
    return p


def run(args: argparse.Namespace) -> int:
    import torch

    from epdserve.bench.offline import default_model, parse_kv
    from epdserve.engine.config import EngineConfig
    from epdserve.engine.llm_engine import LLMEngine
    from epdserve.engine.loaded_model import load_model

    lens = sorted(set(args.output_lens))
    if min(lens) < 1 or args.batch_size < 1 or args.window < 1 or args.repeats < 1 or args.prompt_len < 1:
        raise SystemExit("--output-lens, --batch-size, --window, --repeats and --prompt-len must be >= 1")
    torch.set_num_threads(args.threads)
    model_dir = pathlib.Path(args.model) if args.model else default_model(args.arch, size="tiny")
    engine_args = {"max_num_seqs": args.batch_size, **dict(parse_kv(kv) for kv in args.engine_arg)}

    def config():
        return EngineConfig(model=str(model_dir), device="cpu", **engine_args)

    c = config()
    model = load_model(c.model, c.device, c.dtype, c.max_model_len)
    engines = {L: LLMEngine(config(), model=model) for L in lens}
    runs = []
    for rep in range(args.repeats):
        t0 = time.perf_counter()
        runs.append(measure(engines, args.batch_size, args.window, args.prompt_len, args.seed + rep))
        _log(f"[{rep + 1}/{args.repeats}] {time.perf_counter() - t0:.0f} s: "
             + ", ".join(f"L={L} host {s['host_s'] * 1e3:.2f} ms/step" for L, s in runs[-1].items()))
    report = {
        "benchmark": "host", "model": str(model_dir), "model_name": model_dir.name, "threads": args.threads,
        "batch_size": args.batch_size, "output_lens": lens, "window": args.window, "prompt_len": args.prompt_len,
        "repeats": args.repeats, "engine_args": engine_args, "started": time.strftime("%Y-%m-%dT%H:%M:%S"),
        **summarize(runs, lens),
    }
    report["markdown"] = markdown(report)
    print(report["markdown"])
    out = pathlib.Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=2) + "\n")
    _log(f"wrote {out}")
    return 0


def measure(engines: dict, batch_size: int, window: int, prompt_len: int, seed: int) -> dict[int, dict]:
    """One repeat: output length → median per-step seconds of each part over its window."""
    from epdserve.engine.engine_request import EngineRequest
    from epdserve.engine.sampling_params import SamplingParams

    rng = random.Random(seed)
    ids: dict[int, list[str]] = {}
    for L, engine in sorted(engines.items(), reverse=True):  # the longest first: it takes longest to get there
        # never reached: requests admitted in later steps trail the first by a few tokens; aborted after the window
        params = SamplingParams(max_tokens=L + window + 64, ignore_eos=True)
        text_ids = min(engine.tokenizer.all_special_ids)  # ids below the specials: plain text tokens
        ids[L] = [f"host-{seed}-{L}-{i}" for i in range(batch_size)]
        for rid in ids[L]:
            engine.add_request(EngineRequest(rid, [rng.randrange(text_ids) for _ in range(prompt_len)], [], params))
        while _step(engine, batch_size)[1] < L:
            if not engine.has_unfinished():
                raise RuntimeError(f"output length {L}: the requests ended early")
    steps: dict[int, list[dict]] = {L: [] for L in engines}
    for k in range(window):  # take turns, in alternating order
        for L in sorted(engines, reverse=k % 2 == 1):
            parts, _ = _step(engines[L], batch_size)
            if parts is None:
                raise RuntimeError(f"output length {L}: a step without the whole batch decoding")
            steps[L].append(parts)
    for L, engine in engines.items():
        for rid in ids[L]:
            engine.abort(rid)
        while engine.has_unfinished():
            engine.step()
    return {L: {k: statistics.median(s[k] for s in rows) for k in PARTS} | {"steps": len(rows)}
            for L, rows in sorted(steps.items())}


def _step(engine, batch_size: int) -> tuple[dict | None, int]:
    """One engine step: its time parts (None unless the whole batch decoded) and the shortest output."""
    before = engine.stats.as_dict()
    outs = engine.step()
    after = engine.stats.as_dict()
    shortest = min((len(o.token_ids) for o in outs), default=0)
    full = (after["decode_steps"] > before["decode_steps"]
            and after["decode_tokens"] - before["decode_tokens"] == batch_size)
    return ({k: after[k] - before[k] for k in PARTS} if full else None), shortest


def summarize(runs: list[dict[int, dict]], lens: list[int]) -> dict:
    """Medians over repeats per length, and the longest/shortest host-time ratio per repeat."""
    lo, hi = lens[0], lens[-1]
    ratios = [r[hi]["host_s"] / r[lo]["host_s"] for r in runs]
    per_len = {str(L): {k: statistics.median(r[L][k] for r in runs) for k in PARTS} for L in lens}
    ratio = statistics.median(ratios)
    return {
        "per_output_len": per_len,
        "runs": [{str(L): s for L, s in r.items()} for r in runs],
        "host_ratio": {"longest": hi, "shortest": lo, "median": ratio, "min": min(ratios), "max": max(ratios),
                       "per_repeat": ratios, "aim": AIM, "met": abs(ratio - 1) <= AIM},
    }


def markdown(report: dict) -> str:
    r = report["host_ratio"]
    lines = [f"### host time per decode step: batch {report['batch_size']}, model {report['model_name']}, "
             f"threads {report['threads']}, {report['repeats']} repeat(s) × {report['window']} steps", "",
             "| output tokens | host ms/step | schedule | inputs | update | forward ms/step |", "|---|---|---|---|---|---|"]
    for L, s in report["per_output_len"].items():
        lines.append(f"| {L} | {s['host_s'] * 1e3:.2f} | {s['schedule_s'] * 1e3:.2f} | {s['inputs_s'] * 1e3:.2f} "
                     f"| {s['update_s'] * 1e3:.2f} | {s['forward_s'] * 1e3:.2f} |")
    lines += ["", f"Host time at {r['longest']} vs {r['shortest']} output tokens: {r['median']:.3f}× "
                  f"(repeats {r['min']:.3f}–{r['max']:.3f}; aim 1 ± {r['aim']:.2f}: {'met' if r['met'] else 'MISSED'}).",
              "Per step, host = schedule + inputs + update; each column is a median over a window's steps, then "
              "over repeats.", ""]
    return "\n".join(lines)


def _int_list(s: str) -> list[int]:
    try:
        return [int(x) for x in s.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"want comma-separated integers, got {s!r}") from None


def _log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)
