"""`epdserve bench colocation`: does co-located encode slow decode down, and does encode alone
use every core? — per co-location policy (`epdserve/instance/colocation.py`), in one process.

Two engines share one loaded demo model, as co-located workers do: a decode engine holding a
batch of text requests in their decode phase, and an encode-only engine fed fresh random images.
Each runs on its own fresh thread, set up by the policy exactly as a stage worker is
(`enter_stage_thread`). Per policy and repeat (policies take turns within a repeat, so load
on the machine weighs on each alike):
- `idle`: decode step time (median of `--window` steps) with encode idle;
- `busy`: the same with encode encoding continuously beside it;
- `encode`: images/s encoded alone (decode idle).
Policies: `split` (disjoint core halves), `yield` (all cores, encode at SCHED_IDLE), and
`shared` (all cores at equal priority: no policy, for reference).
Aims a policy is judged by: busy / idle <= `AIM_BUSY_RATIO` (the table says meets / misses), and
an encode-alone rate ≈ the shared one (every core; "encode vs shared"), against split's (half of
them). Each ratio is printed with its min-max over repeats; a difference smaller than the spread
is called noise.
"""
from __future__ import annotations

import argparse
import json
import pathlib
import statistics
import sys
import threading
import time

from epdserve.roles import DECODE, ENCODE, role_set

POLICIES = ("split", "yield", "shared")
IMAGE_PROMPT = "<|vision_start|><|image_pad|><|vision_end|>"
AIM_BUSY_RATIO = 1.2


def add_parser(subparsers) -> argparse.ArgumentParser:
    p = subparsers.add_parser("colocation", help="decode step time with co-located encode busy vs idle, per policy",
                              description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", metavar="DIR", help="checkpoint directory (default: the small demo model, built once)")
    p.add_argument("--arch", choices=("qwen2_vl", "qwen2_5_vl"), default="qwen2_vl")
    p.add_argument("--size", choices=("tiny", "small"), default="small", help="demo model size")
    p.add_argument("--policies", default=",".join(POLICIES), help=f"comma-separated subset of {','.join(POLICIES)}")
    p.add_argument("--batch-size", type=int, default=8, help="requests decoding together")
    p.add_argument("--window", type=int, default=24, help="decode steps measured per sample")
    p.add_argument("--image-size", type=int, default=448, help="side of the square random images")
    p.add_argument("--encode-s", type=float, default=4.0, help="seconds of encode-alone measurement")
    p.add_argument("--repeats", type=int, default=3, help="rounds over the policies")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--device", choices=("cpu", "npu"), default="cpu",
                   help="cpu: the policy comparison above; npu: the hardware check that each stage's kernels keep to "
                        "its core limit (profiler kernel_details Block Dim; checks/npu/colocation.py)")
    p.add_argument("--npu-share", type=float, default=0.5, help="npu: each stage stream's share of the cores")
    p.add_argument("--out", default="bench-colocation.json", help="JSON report path (default: bench-colocation.json)")
    p.set_defaults(func=run)
    return p


def run(args: argparse.Namespace) -> int:
    if args.device == "npu":
        from epdserve.checks.npu import colocation as colocation_npu

        return colocation_npu.run(args)
    policies = [x.strip() for x in args.policies.split(",") if x.strip()]
    if not policies or any(x not in POLICIES for x in policies):
        raise SystemExit(f"--policies: choose from {','.join(POLICIES)}")
    if min(args.batch_size, args.window, args.repeats, args.image_size) < 1 or args.encode_s <= 0:
        raise SystemExit("--batch-size, --window, --repeats, --image-size and --encode-s must be positive")
    rig = _Rig(args)
    runs = []
    for rep in range(args.repeats):
        row = {}
        for policy in policies:
            row[policy] = rig.measure(policy, seed=args.seed + rep)
            _log(f"[{rep + 1}/{args.repeats}] {policy}: decode idle {row[policy]['idle_ms']:.1f} ms, busy "
                 f"{row[policy]['busy_ms']:.1f} ms, encode alone {row[policy]['encode_ips']:.2f} img/s")
        runs.append(row)
    report = {"benchmark": "colocation", "model": str(rig.model_dir), "cores": rig.cores, "load": _load(),
              "args": {k: v for k, v in vars(args).items() if k != "func"}, "runs": runs,
              "summary": summarize(runs, policies)}
    pathlib.Path(args.out).write_text(json.dumps(report, indent=2))
    print(table(report["summary"], policies))
    print(f"wrote {args.out}")
    return 0


class _Rig:
    """The shared model and the two engines; fresh threads per measurement."""

    def __init__(self, args):
        import torch

        from epdserve.bench.offline import default_model
        from epdserve.engine.config import EngineConfig
        from epdserve.engine.llm_engine import LLMEngine
        from epdserve.engine.loaded_model import load_model
        from epdserve.engine.sampling_params import SamplingParams
        from epdserve.platform.cores import available_cores
        from epdserve.seams.feature_provider import LocalFeatureProvider

        self.args, self.cores = args, available_cores()
        torch.set_num_threads(len(self.cores))
        self.model_dir = pathlib.Path(args.model) if args.model else default_model(args.arch, size=args.size)
        c = EngineConfig(model=str(self.model_dir), device="cpu")
        model = load_model(c.model, c.device, c.dtype, c.max_model_len)
        self.decode = LLMEngine(EngineConfig(model=str(self.model_dir), device="cpu", max_num_seqs=args.batch_size),
                                model=model)
        self.encode = LLMEngine(EngineConfig(model=str(self.model_dir), device="cpu", roles="E"), model=model,
                                features=LocalFeatureProvider(max_bytes=64 << 20))
        self.params = SamplingParams(max_tokens=1500, ignore_eos=True)
        self._decoding: list[str] = []
        self._ids = iter(range(1 << 62))

    def measure(self, policy: str, seed: int) -> dict:
        self._fill_decode_batch(policy)
        idle = self._decode_window(policy)
        stop, encoded = threading.Event(), []
        e = self._start_encoder(policy, stop, encoded, seed)
        while not encoded:  # encode is under way before decode is timed
            if not e.is_alive():
                raise RuntimeError("the encode thread ended before encoding one image (see its error above)")
            time.sleep(0.01)
        busy = self._decode_window(policy)
        stop.set()
        e.join()
        for rid in self._decoding:
            self.decode.abort(rid)
        self._decoding.clear()
        while self.decode.has_unfinished():
            self.decode.step()
        stop, encoded = threading.Event(), []
        e = self._start_encoder(policy, stop, encoded, seed + 1000)
        time.sleep(self.args.encode_s)
        stop.set()
        e.join()
        rate = (len(encoded) - 1) / (encoded[-1] - encoded[0]) if len(encoded) > 1 else 0.0
        return {"idle_ms": idle * 1e3, "busy_ms": busy * 1e3, "encode_ips": rate}

    # ---------------------------------------------------------------- threads
    def _cores(self, policy: str, role: str):
        from epdserve.instance.colocation import worker_core_sets

        if policy == "shared":
            return None
        sets = worker_core_sets(policy, [ENCODE, DECODE], self.cores, [0.5, 0.5])
        return sets[1] if role_set(role).holds_kv else sets[0]

    def _on_thread(self, policy: str, role: str, fn):
        from epdserve.instance.colocation import enter_stage_thread

        out: list = []

        def body():
            low = policy == "yield" and not role_set(role).holds_kv  # encode gives way
            enter_stage_thread(self._cores(policy, role), low_priority=low)
            out.append(fn())

        t = threading.Thread(target=body, name=f"bench-{role}-{policy}")
        t.start()
        return t, out

    def _fill_decode_batch(self, policy: str) -> None:
        def fill():
            for _ in range(self.args.batch_size):
                rid = f"d{next(self._ids)}"
                self._decoding.append(rid)
                self.decode.add_request(self.decode.build_request(rid, "describe the weather " * 8, None, self.params))
            for _ in range(4):  # prefill, then a few decode steps
                self.decode.step()

        t, _ = self._on_thread(policy, "D", fill)
        t.join()

    def _decode_window(self, policy: str) -> float:
        """Median decode step time over `--window` steps."""
        def window():
            times = []
            for _ in range(self.args.window):
                t0 = time.perf_counter()
                self.decode.step()
                times.append(time.perf_counter() - t0)
            _log(f"  {policy}: decode step {statistics.median(times) * 1e3:.1f} ms")
            return statistics.median(times)

        t, out = self._on_thread(policy, "D", window)
        t.join()
        return out[0]

    def _start_encoder(self, policy: str, stop: threading.Event, encoded: list, seed: int):
        import numpy as np
        from PIL import Image

        rng = np.random.default_rng([seed, next(self._ids)])  # fresh images every time: never a feature-cache hit
        side = self.args.image_size

        def loop():
            while not stop.is_set():
                img = Image.fromarray(rng.integers(0, 256, (side, side, 3), dtype=np.uint8))
                rid = f"e{next(self._ids)}"
                self.encode.add_request(self.encode.build_request(rid, IMAGE_PROMPT, [img]))
                while self.encode.has_unfinished():
                    self.encode.step()
                encoded.append(time.perf_counter())

        t, _ = self._on_thread(policy, "E", loop)
        return t


# -------------------------------------------------------------------- report
def summarize(runs: list[dict], policies: list[str]) -> dict:
    out = {}
    shared_rates = [r["shared"]["encode_ips"] for r in runs] if "shared" in policies else None
    for p in policies:
        ratios = [r[p]["busy_ms"] / r[p]["idle_ms"] for r in runs]
        s = {"busy_over_idle": _spread(ratios), "idle_ms": _spread([r[p]["idle_ms"] for r in runs]),
             "busy_ms": _spread([r[p]["busy_ms"] for r in runs]),
             "encode_ips": _spread([r[p]["encode_ips"] for r in runs]),
             "meets_busy_aim": statistics.median(ratios) <= AIM_BUSY_RATIO}
        if shared_rates:
            s["encode_vs_shared"] = _spread([r[p]["encode_ips"] / sr for r, sr in zip(runs, shared_rates) if sr > 0])
        out[p] = s
    return out


def _spread(xs: list[float]) -> dict:
    return {"median": statistics.median(xs), "min": min(xs), "max": max(xs), "n": len(xs)}


def table(summary: dict, policies: list[str]) -> str:
    lines = ["policy  | decode busy/idle (min-max)   | decode idle ms | decode busy ms | encode alone img/s | encode vs shared",
             "--------|------------------------------|----------------|----------------|--------------------|-----------------"]
    for p in policies:
        s = summary[p]
        r, ev = s["busy_over_idle"], s.get("encode_vs_shared")
        aim = "meets <= 1.2" if s["meets_busy_aim"] else "misses 1.2"
        lines.append(f"{p:7} | {r['median']:.2f} ({r['min']:.2f}-{r['max']:.2f}) {aim:12} | {s['idle_ms']['median']:14.1f} | "
                     f"{s['busy_ms']['median']:14.1f} | "
                     f"{s['encode_ips']['median']:18.2f} | "
                     + (f"{ev['median']:.2f} ({ev['min']:.2f}-{ev['max']:.2f})" if ev else "-"))
    return "\n".join(lines)


def _load() -> list[float] | None:
    try:
        import os

        return list(os.getloadavg())
    except OSError:
        return None


def _log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)
