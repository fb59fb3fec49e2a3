"""Tensor parallelism on this machine (issue 47): decode TPOT at TP1 and TP2, each rank's peak
memory while loading, and what sending each forward's inputs to the other ranks costs rank 0.

Three measurements, each in fresh processes so no run inherits another's threads or memory:

- `tpot`: the offline `LLM` at --tp degrees, batch B of distinct text prompts, greedy, ignore_eos;
  TPOT = (time of N new tokens - time of 1 new token) / (N - 1) (as decode_tpot.py), --repeats per
  process, --rounds processes per degree alternated (TP1, TP2, TP1, TP2, ...) so a drift of the
  machine hits both; median with min and max over every repeat, and the ratio of the medians.
- `load`: per rank of TP2 (and TP1), the growth of the process's resident set while `load_model`
  runs (a second load in the process, sampled every 2 ms: `child_load`), against the checkpoint's
  file size: all of it, and its anonymous part (the file pages a rank maps count in the first).
- `send`: rank 0's time in `TPGroup.send` (pickling one forward's inputs and writing them to each
  rank's socket) per decode step, against the whole step's time on rank 0.

    python benchmarks/tp_decode.py --model DIR --dtype bfloat16 --batch 1 --batch 32 --out tp.json
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path


def child_tpot(model: str, dtype: str, tp: int, batch: int, tokens: int, repeats: int) -> dict:
    from epdserve import LLM, SamplingParams

    llm = LLM(model=model, device="cpu", dtype=dtype, tensor_parallel_size=tp)
    prompts = [f"Tell me a story number {i} about a dragon and a knight" for i in range(batch)]
    sp = lambda n: SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True)  # noqa: E731
    llm.generate(prompts, sp(4))
    sends: list[float] = []
    if tp > 1:
        group, real_send = llm.engine.tp, llm.engine.tp.send

        def timed_send(*args, **kwargs):
            t = time.perf_counter()
            real_send(*args, **kwargs)
            sends.append(time.perf_counter() - t)
        group.send = timed_send

    def timed(n: int) -> float:
        t = time.perf_counter()
        llm.generate(prompts, sp(n))
        return time.perf_counter() - t

    tpots = []
    for _ in range(repeats):
        sends.clear()
        long = timed(tokens)
        sends_long = sum(sends)
        tpots.append((long - timed(1)) / (tokens - 1))
    llm.engine.close()
    return {"tpot_s": tpots, "send_s_per_step": sends_long / tokens if tp > 1 else 0.0}


def child_load(model: str, dtype: str, rank: int, tp: int) -> dict:
    """The load's own memory, in a fresh process: the modules a load imports are imported first
    (transformers' model class for the checkpoint, its tokenizer and processors: not the load's
    memory), then a thread samples the resident set every 2 ms while `load_model` runs: its peak
    growth, all of it (VmRSS) and the anonymous part (RssAnon: memory the load allocates, without
    the file pages it maps, which the kernel may drop at will)."""
    import gc
    import threading

    from epdserve.engine.loaded_model import load_model
    from epdserve.engine.tp.shard import TPShard

    def status() -> dict[str, int]:
        out = {}
        for line in Path("/proc/self/status").read_text().splitlines():
            key, _, value = line.partition(":")
            if key in ("VmRSS", "RssAnon"):
                out[key] = int(value.split()[0]) * 1024
        return out

    from transformers import AutoConfig, AutoModelForImageTextToText, AutoTokenizer  # noqa: F401

    AutoModelForImageTextToText._model_mapping[type(AutoConfig.from_pretrained(model))]  # imports its modeling module
    AutoTokenizer.from_pretrained(model)
    gc.collect()
    base, peak, done = status(), {"VmRSS": 0, "RssAnon": 0}, threading.Event()

    def sample():
        while not done.is_set():
            for k, v in status().items():
                peak[k] = max(peak[k], v)
            time.sleep(0.002)

    t = threading.Thread(target=sample)
    t.start()
    loaded = load_model(model, "cpu", dtype, shard=TPShard(rank, tp))
    done.set()
    t.join()
    kept = status()
    layer_bytes = sum(t.numel() * t.element_size() for w in loaded.lm.layers for t in w.tensors())
    del loaded
    return {"peak_growth_bytes": peak["VmRSS"] - base["VmRSS"], "peak_anon_growth_bytes": peak["RssAnon"] - base["RssAnon"],
            "kept_bytes": kept["VmRSS"] - base["VmRSS"], "decoder_layers_bytes": layer_bytes}


def _run_child(*args) -> dict:
    out = subprocess.run([sys.executable, __file__, "--child", json.dumps(args)], capture_output=True, text=True)
    if out.returncode != 0:
        raise SystemExit(f"child {args} failed:\n{out.stderr[-4000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def spread(xs: list[float], scale: float = 1e3) -> dict:
    return {"median": statistics.median(xs) * scale, "min": min(xs) * scale, "max": max(xs) * scale, "n": len(xs)}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model")
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--tp", type=int, action="append", help="degrees to compare (default 1 and 2)")
    p.add_argument("--batch", type=int, action="append", help="decode batch sizes (default 1 and 32)")
    p.add_argument("--tokens", type=int, default=33)
    p.add_argument("--repeats", type=int, default=3, help="TPOT repeats per process")
    p.add_argument("--rounds", type=int, default=2, help="processes per degree, alternated")
    p.add_argument("--out", help="write the JSON report here too")
    p.add_argument("--only", choices=("tpot", "load"), help="run one of the measurements")
    p.add_argument("--child", help=argparse.SUPPRESS)
    a = p.parse_args()
    if a.child:
        kind, *rest = json.loads(a.child)
        print(json.dumps((child_tpot if kind == "tpot" else child_load)(*rest)))
        return
    if not a.model:
        p.error("--model is required")
    degrees, batches = a.tp or [1, 2], a.batch or [1, 32]
    files = sum(f.stat().st_size for f in Path(a.model).glob("*.safetensors"))
    report: dict = {"model": a.model, "dtype": a.dtype, "cores": len(os.sched_getaffinity(0)),
                    "checkpoint_bytes": files, "tpot_ms": {}, "send_ms_per_step": {}, "load": {}}
    for batch in batches if a.only != "load" else []:
        runs: dict[int, list[float]] = {tp: [] for tp in degrees}
        sends: dict[int, list[float]] = {tp: [] for tp in degrees}
        for _ in range(a.rounds):
            for tp in degrees:
                r = _run_child("tpot", a.model, a.dtype, tp, batch, a.tokens, a.repeats)
                runs[tp] += r["tpot_s"]
                sends[tp].append(r["send_s_per_step"])
        report["tpot_ms"][batch] = {tp: spread(v) for tp, v in runs.items()}
        report["send_ms_per_step"][batch] = {tp: spread(v) for tp, v in sends.items() if tp > 1}
        base = statistics.median(runs[degrees[0]])
        for tp in degrees[1:]:
            report["tpot_ms"][batch][f"ratio_tp{tp}_over_tp{degrees[0]}"] = statistics.median(runs[tp]) / base
    load_dtype = a.dtype
    for tp in degrees if a.only != "tpot" else []:
        for rank in range(tp):
            runs = [_run_child("load", a.model, load_dtype, rank, tp) for _ in range(a.rounds)]
            report["load"][f"tp{tp}_rank{rank}"] = {
                k + "_over_checkpoint": spread([r[k + "_bytes"] / files for r in runs], 1)
                for k in ("peak_growth", "peak_anon_growth", "kept", "decoder_layers")}
    text = json.dumps(report, indent=1)
    print(text)
    if a.out:
        Path(a.out).write_text(text + "\n")


if __name__ == "__main__":
    main()
