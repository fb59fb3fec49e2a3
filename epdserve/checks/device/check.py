"""`epdserve bench device`: the device check — exactness, every mode served, decode speed — in one
command on whatever device this machine has (CUDA GPU, Ascend NPU, or the CPU), with no package
index (only the repository and installed wheels; scripts/device_check.sh installs those).

Owns the command (`add_parser` / `run`): its flags, the parts' `CheckConfig`, running each part
(`part`) in a process of its own under its own timeout (a hang or a crash costs that part
only; its figures so far are kept), one `RESULT` line per part on stdout, and the report: JSON
(`device-check.json`) and Markdown (`device-check.md`, `report`) in `--out`, beside each
part's log (`<part>.log`) and the profiler tables (`profile-<dtype>.txt`).

Parts, in the order they run: graphs (`graphs`), perf (`perf`), exact (`exact`), tp (`tp`),
serve (`serve`) — the speed tables first.
"""
from __future__ import annotations

import argparse
import json
import os
import pathlib
import signal
import subprocess
import sys
import tempfile
import time

# run in this order: the speed tables first (graphs: tiny model, while the perf part's 2b checkpoint
# builds in the background; then perf), so a call cut short by the device's budget keeps them
PART_NAMES = ("graphs", "perf", "exact", "tp", "serve")
TIMEOUT_ENV = "EPDSERVE_DEVICE_CHECK_{}_TIMEOUT_S"  # EXACT / SERVE / PERF / TP / GRAPHS: a part's default timeout
# an H200 run: ~75 + ~130 + ~170 s (graphs: an estimate, never run on a GPU)
DEFAULT_TIMEOUTS = {"exact": 120.0, "serve": 240.0, "perf": 200.0, "tp": 150.0, "graphs": 120.0}
TOTAL_ENV = "EPDSERVE_DEVICE_CHECK_TIMEOUT_S"
DEFAULT_TOTAL_S = 480.0  # a lent machine has 15 minutes in all, start-up and a rerun included
ALL_MODES = ("monolithic", "P-D", "E-PD", "EP-D", "ED-P", "E-P-D")


DESCRIPTION = """\
The device check of a machine with a GPU (cuda), an NPU (npu) or only the CPU, in one command that
needs no package index. Five parts, run in this order (the speed tables first), each in its own process under its own
timeout, each printing one RESULT line:

  graphs decode graphs against --enforce-eager, bf16: greedy tokens equal at batch 1, 3 and 32 with
         contexts crossing a width bucket mid-run, the evidence (keys, replays, eager steps), TPOT
         both ways at batch 1 and 32, kernels and kernel / graph launches per token both ways, and a
         final empty_cache(); skipped where there are no graphs
  perf   a Qwen2-VL-2B-shaped checkpoint (demo --size 2b: its shapes, demo vocabulary, random
         weights; on CPU the small demo model, fp32 and bf16): decode TPOT at batch 1 and 32 and
         tok/s, transformers generate (eager) the same way, the memory floor (LM bytes /
         --bandwidth), device kernels, host ops and kernel / graph launches per token
         and the attention kernels that ran (torch.profiler), and the served TPOT
         of one request alone against offline
  exact  offline LLM(dtype=float32) greedy == transformers' greedy generate on the same device, for
         the tiny demo model of each family (one image, two images, text only); bf16 agreement
         (common prefix) reported too
  tp     LLM(tensor_parallel_size=2), ranks on devices 0 and 1 (NCCL / HCCL; gloo and shared memory
         on CPU), greedy == transformers' on one device, a dense family and the MoE one (experts
         split over the ranks); skipped, saying so, with fewer than two devices
  serve  `epdserve launch --mode M --device DEV` for every mode: ready time, served greedy tokens ==
         offline, and the P->D KV hop the launcher chose (host when a P and a D share one
         accelerator: NCCL cannot pair two ranks on one device)

Writes device-check.json and device-check.md (one table per part) into --out, beside each part's
log. Timeouts default to exact 120 s, serve 240 s, perf 200 s, tp 150 s, graphs 120 s (or
EPDSERVE_DEVICE_CHECK_{EXACT,SERVE,PERF,TP,GRAPHS}_TIMEOUT_S), and the whole check at most
--total-timeout, 480 s (a part runs under what is left, if less; one with nothing left is reported
not run): about 7 minutes on an H200 without the graphs part (its time is an estimate). scripts/device_check.sh installs wheels from a directory first (--wheels DIR) and runs this.
"""


def _csv(text: str) -> list[str]:
    return [x.strip() for x in text.split(",") if x.strip()]


def _total_timeout() -> float:
    return float(os.environ.get(TOTAL_ENV, DEFAULT_TOTAL_S))


def _timeout(part: str) -> float:
    return float(os.environ.get(TIMEOUT_ENV.format(part.upper()), DEFAULT_TIMEOUTS[part]))


def add_parser(subparsers) -> argparse.ArgumentParser:
    p = subparsers.add_parser(
        "device", help="device check: exactness vs transformers, every mode served, decode speed (GPU / NPU / CPU)",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        description=DESCRIPTION,
    )
    from epdserve.engine.config import EngineConfig
    from epdserve.settings import add_flags
    from epdserve.transfer.kv import KVTransferConfig

    add_flags(p, EngineConfig, ["device"])
    p.add_argument("--out", default="device-check", help="directory for the report and logs (default ./device-check)")
    p.add_argument("--parts", default=",".join(PART_NAMES), help="comma-separated parts to run (default: all)")
    p.add_argument("--work-dir", default=os.path.join(tempfile.gettempdir(), "epdserve-device-check"),
                   help="demo checkpoints (built once, reused by later runs) and launch logs")
    p.add_argument("--total-timeout", type=float, default=_total_timeout(), metavar="S",
                   help="seconds the whole check may run (a lent device's budget): each part runs under the "
                        "smaller of its own timeout and what is left; a part with nothing left is reported "
                        f"not run (or ${TOTAL_ENV})")
    for part in PART_NAMES:
        p.add_argument(f"--{part}-timeout", type=float, default=_timeout(part), metavar="S",
                       help=f"seconds the {part} part may run (default {_timeout(part):g})")
    g = p.add_argument_group("exact")
    g.add_argument("--archs", default="qwen2_vl,qwen2_5_vl,qwen3_vl,qwen3_vl_moe", help="families checked")
    g.add_argument("--exact-dtypes", help="dtypes checked (default: float32,bfloat16 on an accelerator, float32 on CPU)")
    g.add_argument("--exact-tokens", type=int, default=24, help="greedy tokens per prompt")
    g = p.add_argument_group("serve")
    g.add_argument("--modes", default=",".join(ALL_MODES), help="modes launched (default: all six)")
    g.add_argument("--serve-tokens", type=int, default=16, help="greedy tokens per request")
    g.add_argument("--serve-jobs", type=int, help="modes launched at once (default: 3 on an accelerator, 1 on CPU)")
    add_flags(g, KVTransferConfig, ["hop"])  # the launches' --kv-hop
    g = p.add_argument_group("perf")
    g.add_argument("--perf-size", choices=("tiny", "small", "2b"), help="demo size (default: 2b on an accelerator, "
                                                                       "small on CPU)")
    g.add_argument("--perf-dtypes", help="dtypes timed (default: bfloat16 on an accelerator, float32,bfloat16 on CPU)")
    g.add_argument("--perf-tokens", type=int, help="new tokens per timed generate (default 65; CPU 33)")
    g.add_argument("--perf-batch", type=int, default=32, help="the large batch")
    g.add_argument("--perf-repeats", type=int, default=3, help="timed runs per figure, median")
    g.add_argument("--no-served", action="store_true", help="skip the served TPOT (no launch in perf)")
    g.add_argument("--no-transformers", action="store_true", help="skip transformers' generate timings")
    g.add_argument("--bandwidth", type=float, help="device memory bandwidth in bytes/s for the floor (default: "
                                                   "4.8e12 on an H200, else unknown: n/a)")
    p.set_defaults(func=run)
    return p


def resolve_device(device: str) -> str:
    from epdserve.platform import get_platform

    return get_platform(device).name if device == "auto" else device


def config_from_args(args: argparse.Namespace):
    from epdserve.checks.device.env import CheckConfig

    dev = resolve_device(args.device)
    cpu = dev.startswith("cpu")
    return CheckConfig(
        device=dev, work_dir=str(pathlib.Path(args.work_dir).resolve()), out_dir=str(pathlib.Path(args.out).resolve()),
        exact_archs=_csv(args.archs), exact_dtypes=_csv(args.exact_dtypes or ("float32" if cpu else "float32,bfloat16")),
        exact_tokens=args.exact_tokens, modes=_csv(args.modes), serve_tokens=args.serve_tokens,
        serve_jobs=args.serve_jobs or (1 if cpu else 3), kv_hop=args.kv_hop,
        perf_size=args.perf_size or ("small" if cpu else "2b"),
        perf_dtypes=_csv(args.perf_dtypes or ("float32,bfloat16" if cpu else "bfloat16")),
        perf_tokens=args.perf_tokens or (33 if cpu else 65), perf_batch=args.perf_batch,
        perf_repeats=args.perf_repeats, perf_served=not args.no_served, perf_transformers=not args.no_transformers,
        bandwidth=args.bandwidth)


def device_facts(device: str) -> dict:
    import platform as host

    import torch

    facts = {"torch": torch.__version__, "device_name": host.processor() or host.machine()}
    try:
        if device.startswith("cuda"):
            facts["device_name"] = torch.cuda.get_device_name()
            facts["cuda"] = torch.version.cuda
        elif device.startswith("npu"):
            facts["device_name"] = torch.npu.get_device_name()
    except Exception:  # a name is a nicety
        pass
    try:
        root = pathlib.Path(__file__).resolve().parents[2]
        facts["commit"] = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=root, capture_output=True,
                                         text=True, timeout=10).stdout.strip() or None
    except Exception:
        facts["commit"] = None
    return facts


def start_prebuild(cfg) -> subprocess.Popen:
    """Build the perf part's checkpoint in the background (CPU work, while the other parts use the
    device); the perf part waits for it (`env.checkpoint`'s lock). Its log is in the work dir."""
    from epdserve.deploy.local.procs import die_with_parent

    work = pathlib.Path(cfg.work_dir)
    work.mkdir(parents=True, exist_ok=True)
    conf = work / "prebuild.config.json"
    conf.write_text(cfg.to_json())
    with open(work / "prebuild.log", "w") as log:
        return subprocess.Popen([sys.executable, "-m", "epdserve.checks.device.part", "prebuild", str(conf),
                                 str(work / "prebuild.result.json")], stdout=log, stderr=subprocess.STDOUT,
                                start_new_session=True, preexec_fn=die_with_parent())


def part_env(device: str) -> dict[str, str]:
    """A part's environment. On CPU, OMP_WAIT_POLICY=PASSIVE unless the caller chose a policy, as
    `epdserve launch` gives its instances: the offline figures are then measured as the served ones
    are (on a shared host, OpenMP threads spinning while they wait made the small model's offline
    decode 8x slower than served in one run here)."""
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    if device.startswith("cpu"):
        env.setdefault("OMP_WAIT_POLICY", "PASSIVE")
    return env


def run_part(part: str, cfg, timeout_s: float) -> dict:
    """Run one part in its own process (own session) for at most `timeout_s`; its entry of the report."""
    import dataclasses

    work = pathlib.Path(cfg.work_dir)
    work.mkdir(parents=True, exist_ok=True)
    conf, result = work / f"{part}.config.json", work / f"{part}.result.json"
    result.unlink(missing_ok=True)
    conf.write_text(dataclasses.replace(cfg, deadline_s=time.time() + timeout_s).to_json())
    log = pathlib.Path(cfg.out_dir) / f"{part}.log"
    t0 = time.monotonic()
    with open(log, "w") as f:
        proc = subprocess.Popen([sys.executable, "-m", "epdserve.checks.device.part", part, str(conf), str(result)],
                                stdout=f, stderr=subprocess.STDOUT, start_new_session=True, env=part_env(cfg.device))
        try:
            rc = proc.wait(timeout_s)
            status = "ok" if rc == 0 else f"failed (exit {rc})"
        except subprocess.TimeoutExpired:
            status = f"timeout after {timeout_s:g} s"
            _stop(proc)
    figures = json.loads(result.read_text()) if result.exists() else {}
    return {"status": status, "elapsed_s": round(time.monotonic() - t0, 1), "timeout_s": timeout_s,
            "figures": figures, "log": log.name}


def _stop(proc: subprocess.Popen) -> None:
    """SIGTERM the part's process group, SIGKILL what is left after 15 s (its launches die with it)."""
    for sig, wait in ((signal.SIGTERM, 15.0), (signal.SIGKILL, 5.0)):
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            return
        try:
            proc.wait(wait)
            return
        except subprocess.TimeoutExpired:
            continue


def run(args: argparse.Namespace) -> int:
    from epdserve.checks.device.part import summary
    from epdserve.checks.device.report import markdown

    parts = _csv(args.parts)
    unknown = sorted(set(parts) - set(PART_NAMES))
    if unknown:
        raise SystemExit(f"unknown part(s) {', '.join(unknown)}; parts: {', '.join(PART_NAMES)}")
    cfg = config_from_args(args)
    out = pathlib.Path(cfg.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    report = {"benchmark": "device", "device": cfg.device, **device_facts(cfg.device),
              "started": time.strftime("%Y-%m-%dT%H:%M:%S"), "config": json.loads(cfg.to_json()), "parts": {}}
    prebuild = start_prebuild(cfg) if "perf" in parts else None
    deadline = time.monotonic() + args.total_timeout
    for part in parts:
        left = deadline - time.monotonic()
        if left < 1.0:
            entry = {"status": f"not run: the check's {args.total_timeout:g} s (--total-timeout) were spent",
                     "elapsed_s": 0.0, "timeout_s": 0.0, "figures": {}, "log": None}
        else:
            timeout = min(getattr(args, f"{part}_timeout"), round(left, 1))
            print(f"== {part} (timeout {timeout:g} s) {time.strftime('%H:%M:%S')}", flush=True)
            entry = run_part(part, cfg, timeout)
        report["parts"][part] = entry
        print(f"RESULT {part} {cfg.device} {entry['status']} {entry['elapsed_s']}s: "
              f"{summary(part, entry['figures'])}", flush=True)
        (out / "device-check.json").write_text(json.dumps(report, indent=1, default=str))
    if prebuild is not None and prebuild.poll() is None:  # perf ended (timed out?) before the build did
        _stop(prebuild)
    text = markdown(report)
    (out / "device-check.md").write_text(text)
    print(text)
    return 0 if all(e["status"] == "ok" for e in report["parts"].values()) else 1
