"""The step budget's policies side by side on one engine's steps, without the serving path:

    python benchmarks/budget_policy.py --variants "default,h32b8=32/8,no-budget=off" --loads 1,inf,c4 --rounds 3

Issue 50's item 3 asks the budget's policy (engine/step_budget.py) to be chosen from measurements
at light and heavy load. Served runs (vs_transformers_serve.py, aiperf_vs_vllm.py) carry the
front, the scheduler and the gRPC hops on the same two cores, and their rounds swing by ~30%;
this drives `LLMEngine` in one process instead: each variant's engine built once (and warmed),
the same requests arriving at the same offsets (a fixed rate, all at once for `inf`, or a closed
loop of N in flight for `cN`, aiperf's shape), `step()`
called as the instance's loop calls it, every output's time taken as it leaves the engine. The
figures are the serving benchmark's (perf/serving_metrics.py: TTFT, TPOT per request, ITL over
all gaps, SLO goodput) from those times, so they measure the policy's steps and nothing after
them. Rounds alternate the variants' order; each figure is the median over rounds (min-max).

A variant is NAME (the settings' defaults), NAME=H/B (`--step-budget-horizon` H,
`--step-budget-bank` B) or NAME=off (`--no-step-budget`).
"""
from __future__ import annotations

import argparse
import math
import time
from dataclasses import dataclass

from epdserve.bench.peer_compare import median_spread
from epdserve.perf.serving_metrics import RequestRecord, compute_metrics
from epdserve.settings import add_flags, from_flags
from epdserve.slo import SLO, SLO_FLAGS

IMAGE_SIZES = ((320, 180), (480, 270), (640, 360))
PLACEHOLDER = "<|vision_start|><|image_pad|><|vision_end|>"
FIGURES = (("TTFT p50 ms", "ttft_ms", "median"), ("TTFT p99 ms", "ttft_ms", "p99"),
           ("TPOT p50 ms", "tpot_ms", "median"), ("ITL p50 ms", "itl_ms", "median"),
           ("ITL p99 ms", "itl_ms", "p99"), ("SLO goodput req/s", None, "goodput"),
           ("output tok/s", None, "output_throughput"))


@dataclass(frozen=True)
class Variant:
    name: str
    budget: bool = True
    horizon: int | None = None  # None: the setting's default
    bank: float | None = None


def parse_variants(text: str) -> list[Variant]:
    """'default,h32b8=32/8,no-budget=off' -> Variants; a bad entry raises ValueError naming it."""
    out = []
    for item in filter(None, (x.strip() for x in text.split(","))):
        name, _, spec = item.partition("=")
        if not spec:
            out.append(Variant(name))
        elif spec == "off":
            out.append(Variant(name, budget=False))
        else:
            try:
                h, b = spec.split("/")
                out.append(Variant(name, horizon=int(h), bank=float(b)))
            except ValueError:
                raise ValueError(f"variant {item!r}: expected NAME, NAME=H/B or NAME=off") from None
    if len({v.name for v in out}) != len(out):
        raise ValueError(f"variant names repeat in {text!r}")
    return out


@dataclass(frozen=True)
class Load:
    label: str  # "1/s", "inf/s", "c4"
    rate: float  # arrivals per second (inf: all at once, or as the closed loop admits them)
    concurrency: int = 0  # > 0: a closed loop of this many in flight


def parse_loads(text: str) -> list[Load]:
    """'1,inf,c4' -> Loads; a bad entry raises ValueError naming it."""
    out = []
    for item in filter(None, (x.strip() for x in text.split(","))):
        try:
            if item.startswith("c"):
                n = int(item[1:])
                if n < 1:
                    raise ValueError
                out.append(Load(f"c{n}", math.inf, n))
            else:
                rate = float(item)
                if not rate > 0:
                    raise ValueError
                out.append(Load(f"{'inf' if math.isinf(rate) else f'{rate:g}'}/s", rate))
        except ValueError:
            raise ValueError(f"load {item!r}: expected a rate > 0, inf, or cN (N in flight)") from None
    return out


def workload(n: int, image_share: float, output_len: int, rate: float, seed: int = 0,
             spread: float = 0.0) -> list[tuple[float, str, list, int]]:
    """(arrival offset s, prompt, images, max_tokens) per request: every 1/image_share-th with one
    image (the sizes in turn), distinct texts, arrivals 1/rate apart (all at 0 for inf), output
    lengths spread evenly over output_len x (1 +- `spread`) in a shuffled order (equal lengths
    would march a closed loop's requests in lockstep: all admitted together, all ending
    together, nothing decoding while they encode — not what a served loop's jittered clients
    see). Another `seed` gives other images and texts (a round that repeated one would hit the
    engine's encoder and prefix caches)."""
    from epdserve.model.demo_images import procedural_image

    every = max(1, round(1 / image_share)) if image_share > 0 else 0
    reqs = []
    for i in range(n):
        image = bool(every) and i % every == every - 1
        imgs = [procedural_image(*IMAGE_SIZES[(i // max(every, 1)) % len(IMAGE_SIZES)], seed=seed * 10_000 + i)
                ] if image else []
        prompt = (PLACEHOLDER if image else "") + f"Request {seed}.{i}: tell me about the picture and a dragon " * 2
        frac = (i * 0.618034) % 1.0  # golden-ratio steps: evenly spread, not monotone
        length = max(1, round(output_len * (1 - spread + 2 * spread * frac)))
        reqs.append((0.0 if math.isinf(rate) else i / rate, prompt, imgs, length))
    return reqs


def build_engine(model: str, dtype: str, variant: Variant, slo_tpot_ms: float):
    from epdserve.engine.config import EngineConfig
    from epdserve.engine.llm_engine import LLMEngine

    extra = {k: v for k, v in (("step_budget_horizon", variant.horizon), ("step_budget_bank", variant.bank))
             if v is not None}
    return LLMEngine(EngineConfig(model=model, device="cpu", dtype=dtype, slo_tpot_ms=slo_tpot_ms,
                                  step_budget=variant.budget, **extra))


def run_once(engine, reqs, tag: str, concurrency: int = 0) -> list[RequestRecord]:
    """Feed `reqs` at their offsets (with `concurrency` > 0: as a closed loop instead, the next one
    when fewer than that many are in flight, aiperf's shape), step until all end; one record per
    request (monotonic times)."""
    from epdserve.engine.sampling_params import SamplingParams

    built = [(off, engine.build_request(f"{tag}-{i}", prompt, imgs or None,
                                        SamplingParams(max_tokens=m, ignore_eos=True, temperature=0.0)),
              "image" if imgs else "text", m) for i, (off, prompt, imgs, m) in enumerate(reqs)]
    records = {req.request_id: RequestRecord(req.request_id, 0.0, kind=kind, num_images=int(kind == "image"),
                                             expected_output_tokens=m) for _, req, kind, m in built}
    start, queue, in_flight = time.monotonic(), list(built), 0
    while queue or engine.has_unfinished():
        now = time.monotonic()
        while queue and (in_flight < concurrency if concurrency else start + queue[0][0] <= now):
            off, req, _, _ = queue.pop(0)
            records[req.request_id].t0 = now if concurrency else start + off
            engine.add_request(req)
            in_flight += 1
        if not engine.has_unfinished():
            time.sleep(max(0.0, start + queue[0][0] - time.monotonic()))  # idle until the next arrival
            continue
        for out in engine.step():
            rec, t = records[out.request_id], time.monotonic()
            if out.new_token_ids:
                rec.chunk_times.append(t)
                rec.chunk_tokens.append(len(out.new_token_ids))
            if out.finished:
                rec.end, rec.success, rec.error = t, out.error is None, out.error or ""
                rec.output_tokens = len(out.token_ids)
                in_flight -= 1
    return list(records.values())


def table(results: dict[str, dict[str, list[dict]]], loads: list[Load]) -> list[str]:
    lines = ["| load | variant | " + " | ".join(f[0] for f in FIGURES) + " |",
             "|---|---|" + "---:|" * len(FIGURES)]
    for load in loads:
        for name, by_load in results.items():
            runs = by_load.get(load.label, [])
            cells = [median_spread([v for v in ((m[key][stat] if key else m[stat]) for m in runs) if v is not None],
                                   3 if stat == "goodput" else 1) for _, key, stat in FIGURES]
            lines.append(f"| {load.label} | {name} | " + " | ".join(cells) + " |")
    return lines


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", help="checkpoint (default: the small demo Qwen2-VL, built once)")
    ap.add_argument("--variants", default="default,no-budget=off",
                    help="comma-separated NAME, NAME=H/B (horizon/bank) or NAME=off (no budget)")
    ap.add_argument("--loads", default="1,inf,c4", help="comma-separated: a request rate per second, inf (all at "
                                                        "once), or cN (a closed loop of N in flight, aiperf's shape)")
    ap.add_argument("--requests", type=int, default=24)
    ap.add_argument("--image-share", type=float, default=0.5, help="share of requests with one image")
    ap.add_argument("--output-len", type=int, default=32, help="output tokens per request, the mean (ignore_eos)")
    ap.add_argument("--output-spread", type=float, default=0.5,
                    help="output lengths spread over LEN x (1 +- this) (default 0.5; 0: all LEN, which marches a "
                         "closed loop in lockstep)")
    ap.add_argument("--dtype", default="float32", help="the engines' dtype (default float32: this CPU's fast one)")
    add_flags(ap, SLO, SLO_FLAGS)  # the TPOT objective is also the engines' budget (epdserve/slo.py)
    ap.add_argument("--rounds", type=int, default=3, help="rounds, the variants' order alternating")
    ap.add_argument("--out", help="write the Markdown report here too")
    a = ap.parse_args(argv)
    variants = parse_variants(a.variants)
    loads = parse_loads(a.loads)
    if a.model is None:
        from epdserve.model.demo_cache import cached_demo_model

        a.model = str(cached_demo_model("qwen2_vl", "small"))
    slo = from_flags(SLO, a)
    engines = {v.name: build_engine(a.model, a.dtype, v, slo.tpot_ms) for v in variants}
    for name, eng in engines.items():  # warm: the costs the budget plans with are measured in service
        run_once(eng, workload(4, a.image_share, 8, math.inf, seed=9_999), f"warm-{name}")
    results: dict[str, dict[str, list[dict]]] = {v.name: {} for v in variants}
    for k in range(a.rounds):
        order = variants if k % 2 == 0 else variants[::-1]
        for load in loads:
            reqs = workload(a.requests, a.image_share, a.output_len, load.rate, seed=k * len(loads) + loads.index(load),
                            spread=a.output_spread)
            for v in order:
                records = run_once(engines[v.name], reqs, f"r{k}-{load.label}", load.concurrency)
                m = compute_metrics(records, slo, by_kind=False)
                results[v.name].setdefault(load.label, []).append(m)
                print(f"round {k + 1} {load.label} {v.name}: TTFT p50 {m['ttft_ms']['median']:.0f} ms, TPOT p50 "
                      f"{m['tpot_ms']['median']:.1f} ms, ITL p50 {m['itl_ms']['median']:.1f} ms", flush=True)
    header = [f"budget policies, one engine each in one process ({a.dtype}): {a.requests} requests, "
              f"{a.image_share:.0%} with one image ({'/'.join(f'{w}x{h}' for w, h in IMAGE_SIZES)} in turn), "
              f"{a.output_len} tokens (x 1 +- {a.output_spread:g}), SLO TTFT {slo.ttft_ms:g} / TPOT {slo.tpot_ms:g} ms; {a.rounds} round(s), the variants' order "
              "alternating; each figure the median over rounds (min-max)", ""]
    report = "\n".join(header + table(results, loads)) + "\n"
    print(report)
    if a.out:
        with open(a.out, "w") as f:
            f.write(report)
    return 0
