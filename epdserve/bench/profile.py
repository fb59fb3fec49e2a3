"""`epdserve profile --model DIR`: what each stage costs on this device, to size a deployment.

Owns the command: its flags, the JSON file it writes and the short table it prints. The
measurements are perf/profiler.py (`run_profile`), all through the engine directly (no server):
vision encoder ms per image at several resolutions (JPEG decode + preprocessing timed apart),
prefill ms per prompt length, decode ms per step at several batch sizes, and the bytes that travel
between stages (image features E→P, KV cache P→D) per request. Each number is the median of
`repeats` runs after one warm-up. Output: one JSON document (and a short table on stdout).
"""
from __future__ import annotations

import argparse
import json
import pathlib

from epdserve.commands import add_command
from epdserve.engine.config import EngineConfig
from epdserve.perf.profiler import DEFAULT_BATCH_SIZES, DEFAULT_PROMPT_LENS, DEFAULT_RESOLUTIONS, int_list, run_profile
from epdserve.perf.workload import RESOLUTIONS
from epdserve.settings import add_flags


def markdown(report: dict) -> str:
    mb = 1 / (1 << 20)
    tp = report.get("tensor_parallel_size", 1)
    lines = [f"## profile: {report['model']} on {report['device']} ({report['dtype']}, "
             f"{report['torch_threads']} threads{f', tensor_parallel_size {tp}' if tp > 1 else ''})", "",
             "| image | vision tokens | preprocess ms | encode ms | feature MB |", "|---|---:|---:|---:|---:|"]
    lines += [f"| {v['resolution']} ({v['width']}x{v['height']}) | {v['vision_tokens']} | {v['preprocess_ms']:.1f} | "
              f"{v['encode_ms']:.1f} | {v['feature_bytes'] * mb:.2f} |" for v in report["vision"]]
    lines += ["", "| prompt tokens | prefill ms | tok/s |", "|---:|---:|---:|"]
    lines += [f"| {p['prompt_tokens']} | {p['prefill_ms']:.1f} | {p['prefill_tokens_per_s']:.0f} |"
              for p in report["prefill"]]
    lines += ["", "| decode batch | ms/step | tok/s |", "|---:|---:|---:|"]
    lines += [f"| {d['batch_size']} | {d['decode_ms_per_step']:.1f} | {d['decode_tokens_per_s']:.0f} |"
              for d in report["decode"]]
    lines += ["", "| one request alone | prompt tokens | est. TTFT ms |", "|---|---:|---:|"]
    lines += [f"| {u['request']} | {u['prompt_tokens']} | {u['ttft_ms']:.0f} |" for u in report["unloaded_ttft"]]
    lines += ["", f"KV: {report['kv_bytes_per_token']} B/token", "",
              "| request | prompt tokens | features E→P MB | KV P→D MB |", "|---|---:|---:|---:|"]
    lines += [f"| {r['resolution']} | {r['prompt_tokens']} | {r['feature_bytes'] * mb:.2f} | {r['kv_bytes'] * mb:.2f} |"
              for r in report["per_request"]]
    return "\n".join(lines)


def add_parser(subparsers) -> argparse.ArgumentParser:
    p = add_command(subparsers, "profile", run,
                    "per-stage cost on this device (vision, prefill, decode, bytes moved) -> JSON", __doc__)
    p.add_argument("--model", required=True, metavar="DIR", help="checkpoint directory")
    add_flags(p, EngineConfig, ["device", "tensor_parallel_size"])  # a profile per degree: `epdserve plan` takes several
    p.add_argument("--resolutions", default=DEFAULT_RESOLUTIONS,
                   help=f"images to encode: names ({','.join(RESOLUTIONS)}) or WxH (default {DEFAULT_RESOLUTIONS})")
    p.add_argument("--prompt-lens", default=DEFAULT_PROMPT_LENS, help=f"prefill lengths (default {DEFAULT_PROMPT_LENS})")
    p.add_argument("--batch-sizes", default=DEFAULT_BATCH_SIZES, help=f"decode batch sizes (default {DEFAULT_BATCH_SIZES})")
    p.add_argument("--decode-steps", type=int, default=8, help="decode steps timed per batch size")
    p.add_argument("--decode-context", type=int, default=128, help="prompt tokens of each decoding request")
    p.add_argument("--repeats", type=int, default=3, help="timed runs per point after one warm-up")
    p.add_argument("--threads", type=int, help="torch intra-op threads (default: torch's)")
    p.add_argument("--out", default="profile.json", help="JSON path")
    return p


def run(args: argparse.Namespace) -> int:
    if args.threads:
        import torch

        torch.set_num_threads(args.threads)
    report = run_profile(args.model, args.device, [r for r in args.resolutions.split(",") if r.strip()],
                         int_list(args.prompt_lens), int_list(args.batch_sizes), max(1, args.repeats),
                         max(1, args.decode_steps), args.decode_context,
                         tensor_parallel_size=args.tensor_parallel_size)
    out = pathlib.Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=2) + "\n")
    print(markdown(report))
    print(f"\nwrote {out}")
    return 0
