"""`epdserve bench serve`: serving benchmark of live deployments, the modes side by side in one run.

Owns the command: either `--address HOST:PORT` (one live deployment), `--backend openai
--base-url URL` (any OpenAI-compatible server, epdserve's HTTP front included) or `--modes
monolithic,E-PD,... --model DIR` (each mode launched in turn with `epdserve launch`, stopped
after). Every target gets a warm-up, then the same seeded ShareGPT-4o-shaped workloads at the
same arrival schedules (each rate of a sweep with its own fresh images, so no run is served from
a previous run's cache). Reported: the metrics of vLLM's and SGLang's serving benchmarks
(TTFT, TPOT p50/p90/p99 over requests, ITL p50/p99 over all inter-token gaps, E2EL, goodput: the
requests meeting both `--slo-ttft-ms` and `--slo-tpot-ms`, per second) plus the TTFT split by
stage, with ratios against the first target; the log line of each run prints the same TPOT and ITL
percentiles. Results: one JSON (written after every run, so a stopped benchmark keeps what it
measured), a Markdown table (stdout and `<out>.md`) and one PNG per workload. `--workload shift`
changes the traffic's shape mid-run (image-heavy -> text-heavy -> mixed) and adds per-phase
figures and a timeline PNG (bench/shift.py). `--workload multiturn` runs `--conversations`
conversations of `--turns` turns over their images, each turn after the previous answer plus
`--think-time-s`, conversations started at the request rate, and adds TTFT per turn
(bench/multiturn.py). `--workload upload-then-ask` uploads an image (encoded at upload), waits
`--think-time-s`, asks about it by file id, beside the same question carrying the bytes and
without an image (bench/upload_ask.py). `--workload multi-image`: 4 images of 640x360 a request.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import pathlib
import shlex
import sys
import time
from contextlib import nullcontext

from epdserve.bench.multiturn import add_arguments as add_multiturn_arguments
from epdserve.bench.multiturn import multiturn_config, run_multiturn
from epdserve.bench.multiturn_report import turn_summary
from epdserve.bench.report import latency_summary, markdown, plot, request_rows
from epdserve.bench.roster_watch import RosterWatch
from epdserve.bench.serve_runner import ClientBackend, RunConfig, run_requests, send_one
from epdserve.bench.upload_ask import UPLOAD_THEN_ASK, UploadAskConfig, run_upload_ask, upload_ask_config
from epdserve.bench.upload_ask import summary_line as upload_summary
from epdserve.bench.shift import DEFAULT_PHASES, SHIFT, ShiftConfig, annotate_rows, build_shift, phase_metrics, shift_config
from epdserve.commands import add_command
from epdserve.settings import add_flags, from_flags
from epdserve.slo import SLO
from epdserve.instance.modes import MODES as DEPLOYMENT_MODES
from epdserve.perf.multiturn import MULTITURN, MultiturnConfig
from epdserve.perf.presets import PRESET_RATES, PRESETS
from epdserve.perf.serving_metrics import compute_metrics
from epdserve.perf.workload import WorkloadConfig, build_workload, parse_mix

MODES = (*DEPLOYMENT_MODES, "auto")  # auto: the planner's start + the role controller


def add_parser(subparsers) -> argparse.ArgumentParser:
    p = add_command(subparsers, "serve", run,
                    "serving benchmark: TTFT/TPOT/ITL/E2EL, goodput under SLOs, modes side by side", __doc__)
    t = p.add_argument_group("target")
    t.add_argument("--address", metavar="HOST:PORT", help="a live deployment's scheduler (epdserve gRPC API)")
    t.add_argument("--backend", choices=("epdserve", "openai"), default="epdserve",
                   help="epdserve: the gRPC API at --address; openai: an OpenAI-compatible server at --base-url "
                        "(epdserve --http-port, vLLM, SGLang, transformers serve), requests shaped as "
                        "`vllm bench serve --backend openai-chat` sends them")
    t.add_argument("--base-url", metavar="URL", help="with --backend openai: e.g. http://127.0.0.1:8000 (or .../v1)")
    t.add_argument("--served-model", help="with --backend openai: model name (default: the server's first)")
    t.add_argument("--api-key", default=None, help="with --backend openai: API key (default: $EPDSERVE_API_KEY)")
    t.add_argument("--no-vllm-extras", action="store_true",
                   help="with --backend openai: send no vLLM extras (ignore_eos, return_token_ids), for servers that "
                        "refuse unknown fields (transformers serve); outputs may then end early at EOS")
    t.add_argument("--label", default="live", help="name of the --address target in the report")
    t.add_argument("--modes", help=f"comma-separated modes to launch in turn ({','.join(MODES)}); "
                                   "the first is the baseline of the ratios. MODE#NAME is a variant of a mode with its "
                                   "own --mode-arg, e.g. 'P-D,P-D#2P' with --mode-arg 'P-D#2P=--prefill 2'")
    t.add_argument("--model", metavar="DIR", help="checkpoint for --modes (default: the small demo model, built once)")
    t.add_argument("--launch-arg", action="append", default=[], metavar="ARGS",
                   help="extra arguments for every `epdserve launch` (shell-quoted, repeatable)")
    t.add_argument("--mode-arg", action="append", default=[], metavar="MODE=ARGS",
                   help="extra `epdserve launch` arguments for one mode (or MODE#NAME variant), e.g. "
                        "'E-P-D=--decode 2' (repeatable)")
    t.add_argument("--env", action="append", default=[], metavar="KEY=VALUE",
                   help="environment of every launched deployment, e.g. OMP_WAIT_POLICY=PASSIVE (repeatable)")
    t.add_argument("--launch-timeout", type=float, default=600.0, help="seconds to wait for a ready line")
    w = p.add_argument_group("workload (a preset, with any knob overridden)")
    w.add_argument("--workload", default="sharegpt4o",
                   help=f"comma-separated presets: {','.join(PRESETS)}, or {SHIFT}: image-heavy -> text-heavy -> "
                        f"mixed in one run, arrivals continuous, metrics per phase, or {MULTITURN}: conversations "
                        "over their images, TTFT per turn (the rate: conversations per second), or "
                        f"{UPLOAD_THEN_ASK}: upload an image, think, ask by file id, beside the same question "
                        "carrying its bytes and without an image (default sharegpt4o)")
    w.add_argument("--shift-phases", metavar="PRESET[:F],...",
                   help=f"with --workload {SHIFT}: its phases in order, each optionally with a factor on the request "
                        "rate, e.g. image-heavy,text-heavy:3,mixed:2 (default image-heavy,text-heavy,mixed)")
    w.add_argument("--num-requests", type=int, help="requests per run")
    w.add_argument("--images-per-request", metavar="N|A-B", help="images per image request (uniform in A..B)")
    w.add_argument("--resolution-mix", metavar="RES:W,...", help="e.g. 360p:0.5,720p:0.3,1080p:0.2 (names or WxH)")
    w.add_argument("--resolution-scale", type=float, help="scale both sides of every resolution")
    w.add_argument("--output-len", type=float, help="mean output tokens (clipped normal; max_tokens + ignore_eos)")
    w.add_argument("--output-len-std", type=float, help="std of output tokens")
    w.add_argument("--output-len-range", metavar="MIN-MAX", help="clip output tokens to this range")
    w.add_argument("--text-only-share", type=float, help="share of text-only requests (mixed traffic)")
    w.add_argument("--repeated-image-share", type=float, help="share of image slots reusing an earlier image")
    w.add_argument("--seed", type=int, default=0, help="workload and arrival seed")
    add_multiturn_arguments(w)
    a = p.add_argument_group("arrivals")
    a.add_argument("--request-rate", default="preset", metavar="R[,R...]",
                   help="requests/s, a comma-separated sweep; inf = all at once; preset = each workload's own "
                        "CPU-scaled sweep (default preset)")
    a.add_argument("--burstiness", type=float, default=1.0, help="gamma shape of inter-arrivals; 1 = Poisson")
    a.add_argument("--max-concurrency", type=int, help="at most this many requests in flight (closed loop with rate inf)")
    a.add_argument("--warmup", type=int, default=2, help="warm-up requests per target, not measured")
    s = p.add_argument_group("SLOs (scale them to the machine and say so)")
    add_flags(s, SLO)
    s.add_argument("--slo-note", default="", help="how the SLOs were scaled (goes into the report)")
    o = p.add_argument_group("output")
    o.add_argument("--out", default="bench-serve.json", help="JSON report (default bench-serve.json); also <out>.md")
    o.add_argument("--plots", metavar="DIR", help="PNG directory (default: next to --out)")
    o.add_argument("--plot-prefix", help="PNG name prefix (default: the JSON's stem)")
    o.add_argument("--no-progress", action="store_true", help="no progress bar")
    return p


def workload_configs(args) -> list[WorkloadConfig]:
    out = []
    for name in [n.strip() for n in args.workload.split(",") if n.strip()]:
        if name == MULTITURN:
            out.append(multiturn_config(args))
            continue
        if name == UPLOAD_THEN_ASK:
            out.append(upload_ask_config(args))
            continue
        if name not in PRESETS and name != SHIFT:
            raise SystemExit(f"unknown workload {name!r}; presets: {', '.join(PRESETS)}, {SHIFT}, {MULTITURN}, "
                             f"{UPLOAD_THEN_ASK}")
        changes: dict = {"seed": args.seed}
        if args.num_requests:
            changes["num_requests"] = args.num_requests
        if args.images_per_request:
            lo, _, hi = args.images_per_request.partition("-")
            changes.update(images_min=int(lo), images_max=int(hi or lo))
        if args.resolution_mix:
            changes["resolution_mix"] = parse_mix(args.resolution_mix)
        for arg, fld in (("resolution_scale", "resolution_scale"), ("output_len", "output_len_mean"),
                         ("output_len_std", "output_len_std"), ("text_only_share", "text_only_share"),
                         ("repeated_image_share", "repeated_image_share")):
            if getattr(args, arg) is not None:
                changes[fld] = getattr(args, arg)
        if args.output_len_range:
            lo, _, hi = args.output_len_range.partition("-")
            changes.update(output_len_min=int(lo), output_len_max=int(hi))
        elif args.output_len is not None:
            changes.update(output_len_min=1, output_len_max=max(int(2 * args.output_len), 1))
        if name == SHIFT:
            try:
                out.append(shift_config(changes, *parse_phases(args.shift_phases)))
            except ValueError as e:
                raise SystemExit(f"--workload {SHIFT}: {e}") from None
        else:
            out.append(PRESETS[name].with_(**changes))
    return out


def parse_phases(spec: str | None) -> tuple[tuple[str, ...], tuple[float, ...]]:
    """`--shift-phases` "image-heavy,text-heavy:3" -> (("image-heavy", "text-heavy"), (1.0, 3.0))."""
    if not spec:
        return DEFAULT_PHASES, ()
    names, factors = [], []
    for item in [x.strip() for x in spec.split(",") if x.strip()]:
        name, _, f = item.partition(":")
        try:
            factors.append(float(f) if f else 1.0)
        except ValueError:
            raise SystemExit(f"--shift-phases: {item!r}: the factor after ':' must be a number") from None
        names.append(name.strip())
    return tuple(names), (tuple(factors) if any(f != 1.0 for f in factors) else ())


def describe(cfg: WorkloadConfig | ShiftConfig | MultiturnConfig | UploadAskConfig) -> str:
    if isinstance(cfg, (ShiftConfig, MultiturnConfig, UploadAskConfig)):
        return cfg.summary()
    img = f"{cfg.images_min}" if cfg.images_min == cfg.images_max else f"{cfg.images_min}-{cfg.images_max}"
    mix = "/".join(f"{n}:{w:g}" for n, w in cfg.resolution_mix)
    return (f"{cfg.num_requests} requests, {100 * cfg.text_only_share:.0f}% text-only, {img} image(s) per image "
            f"request ({mix} x{cfg.resolution_scale:g}), output {cfg.output_len_mean:g}+-{cfg.output_len_std:g} "
            f"tokens [{cfg.output_len_min}, {cfg.output_len_max}], {100 * cfg.repeated_image_share:.0f}% repeated images"
            + (f", {100 * cfg.video_share:.0f}% with one clip ({'/'.join(n for n, _ in cfg.video_mix)}, "
               f"{'/'.join(f'{s:g}' for s in cfg.video_seconds)} s)" if cfg.video_share else ""))


def parse_rates(text: str, workload: str | None = None) -> list[float]:
    if text.strip() == "preset":
        return list(PRESET_RATES.get(workload, (math.inf,)))
    rates = [math.inf if r.strip().lower() == "inf" else float(r) for r in text.split(",") if r.strip()]
    if not rates or any(r <= 0 for r in rates):
        raise SystemExit(f"--request-rate: positive numbers or inf, got {text!r}")
    return rates


def run_target(backend, label: str, workloads: list[WorkloadConfig], rates: str, args, slo: SLO,
               report: dict, save) -> None:
    """Warm up, then every workload at every rate against one target; results go into `report`."""
    warm = [*build_workload(PRESETS["sharegpt4o"].with_(name="warmup", num_requests=max(1, args.warmup - 1),
                                                         text_only_share=0.0, output_len_mean=4, output_len_std=0,
                                                         output_len_min=4, output_len_max=4, seed=args.seed)),
            *build_workload(PRESETS["sharegpt4o"].with_(name="warmup-text", num_requests=1, text_only_share=1.0,
                                                        output_len_mean=4, output_len_std=0, output_len_min=4,
                                                        output_len_max=4, seed=args.seed))][: args.warmup]
    for req in warm:
        rec = send_one(backend, req)
        if not rec.success:
            _log(f"[{label}] warm-up request failed: {rec.error}")
    for cfg in workloads:
        entry = report["workloads"].setdefault(cfg.name, {"config": cfg.to_dict(), "summary": describe(cfg),
                                                          "modes": {}})
        mode_entry = entry["modes"].setdefault(label, {"runs": []})
        for i, rate in enumerate(parse_rates(rates, cfg.name)):
            run_cfg = cfg.with_(seed=cfg.seed + 1000 * i)  # fresh images per rate, same for every target
            multiturn = isinstance(run_cfg, MultiturnConfig)
            upload_ask = isinstance(run_cfg, UploadAskConfig)
            shift = build_shift(run_cfg, rate, args.burstiness) if isinstance(run_cfg, ShiftConfig) else None
            requests = shift.requests if shift else None if multiturn or upload_ask else build_workload(run_cfg)
            rc = RunConfig(rate=rate, burstiness=args.burstiness, max_concurrency=args.max_concurrency,
                           seed=run_cfg.seed, progress=not args.no_progress, label=f"{label} {cfg.name} {rate:g}/s")
            t0, load0 = time.time(), _load()
            watch = RosterWatch(backend.address) if shift and getattr(backend, "address", None) else nullcontext()
            extra: dict = {}
            with watch:
                if multiturn:
                    records, extra = run_multiturn(backend, run_cfg, rc, slo)
                elif upload_ask:
                    records, extra = run_upload_ask(backend, run_cfg, rc, slo)
                else:
                    records = run_requests(backend, requests, rc, offsets=shift.offsets if shift else None)
            m = compute_metrics(records, slo)
            run_entry = {"rate": rate, "burstiness": args.burstiness, "max_concurrency": args.max_concurrency,
                         "seed": run_cfg.seed, "wall_s": round(time.time() - t0, 2), "load_avg_1m": [load0, _load()],
                         "metrics": m, "requests": request_rows(records), **extra}
            if shift:
                run_entry.update(annotate_rows(run_entry["requests"], records, shift, slo),
                                 phases=phase_metrics(shift, records, slo),
                                 events=getattr(watch, "events", []))  # role changes on the time axis
            mode_entry["runs"].append(run_entry)
            _log(f"[{label}] {cfg.name} @ {rc.describe()}: {m['completed']}/{m['num_requests']} ok, "
                 f"goodput {m['goodput']:.3f} req/s, SLO {100 * m['slo_attainment']:.0f}%, "
                 f"TTFT p50 {m['ttft_ms']['median'] or 0:.0f} ms, {latency_summary(m)}"
                 + (f", {turn_summary(extra['turns'])}" if "turns" in extra else "")
                 + (f"; {upload_summary(extra)}" if "upload_then_ask" in extra else ""))
            save()


def run(args: argparse.Namespace) -> int:
    if args.backend == "openai":
        if not args.base_url or args.modes:
            raise SystemExit("--backend openai needs --base-url URL (and no --modes)")
    elif bool(args.address) == bool(args.modes):
        raise SystemExit("give exactly one of --address HOST:PORT or --modes M1,M2,...")
    workloads = workload_configs(args)
    rates = args.request_rate
    for cfg in workloads:
        parse_rates(rates, cfg.name)  # fail early on a bad value
    try:
        slo = from_flags(SLO, args)
    except ValueError as e:
        raise SystemExit(f"epdserve bench serve: {e}") from None
    out = pathlib.Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    report = {"benchmark": "serve", "started": time.strftime("%Y-%m-%dT%H:%M:%S"),
              "command": "epdserve bench serve " + " ".join(shlex.quote(a) for a in sys.argv[3:])
              if sys.argv[1:3] == ["bench", "serve"] else " ".join(shlex.quote(a) for a in sys.argv),
              "slo": slo.to_dict(), "slo_note": args.slo_note, "rates": rates, "burstiness": args.burstiness,
              "max_concurrency": args.max_concurrency, "cpus": os.cpu_count(), "targets": {}, "workloads": {}}

    def save():
        out.write_text(json.dumps(_clean(report), indent=1, allow_nan=False) + "\n")

    if args.backend == "openai":
        from epdserve.bench.openai_backend import OpenAIBackend

        backend = OpenAIBackend(args.base_url, args.served_model, args.api_key or os.environ.get("EPDSERVE_API_KEY"),
                                vllm_extras=not args.no_vllm_extras)
        report["targets"][args.label] = {"base_url": args.base_url, "backend": "openai", "model": backend.model}
        try:
            run_target(backend, args.label, workloads, rates, args, slo, report, save)
        finally:
            backend.close()
    elif args.address:
        report["targets"][args.label] = {"address": args.address}
        backend = ClientBackend(args.address)
        try:
            run_target(backend, args.label, workloads, rates, args, slo, report, save)
        finally:
            backend.close()
    else:
        _launch_all(args, workloads, rates, slo, report, save)
    report["finished"] = time.strftime("%Y-%m-%dT%H:%M:%S")
    save()
    table = markdown(report, baseline=(args.modes.split(",")[0].strip() if args.modes else None))
    out.with_suffix(".md").write_text(table + "\n")
    pngs = plot(report, args.plots or out.parent, args.plot_prefix or out.stem)
    print(table)
    print(f"\nwrote {out}, {out.with_suffix('.md')}" + "".join(f", {p}" for p in pngs))
    return 0


def _launch_all(args, workloads, rates, slo, report, save) -> None:
    from epdserve.deploy.local.launched import LaunchError, launched, variant_args, variant_mode

    model = args.model
    if not model:
        from epdserve.bench.offline import default_model

        model = str(default_model("qwen2_vl"))
    report["model"] = str(model)
    per_mode = variant_args(args.mode_arg)
    common = [a for item in args.launch_arg for a in shlex.split(item)]
    env = dict(item.split("=", 1) for item in args.env)
    report["launch_env"] = env
    for mode in [m.strip() for m in args.modes.split(",") if m.strip()]:
        base = variant_mode(mode)
        if base not in MODES:
            raise SystemExit(f"unknown mode {base!r}; modes: {', '.join(MODES)}")
        extra = common + per_mode.get(mode, [])
        target = report["targets"].setdefault(mode, {"launch_args": extra})
        _log(f"[{mode}] launching ...")
        try:
            with launched(base, model, extra, ready_timeout_s=args.launch_timeout, env=env) as dep:
                target.update(address=dep.address, ready_s=round(dep.ready_s, 2), ready_line=dep.ready_line)
                _log(f"[{mode}] ready at {dep.address} after {dep.ready_s:.1f} s")
                backend = ClientBackend(dep.address)
                try:
                    run_target(backend, mode, workloads, rates, args, slo, report, save)
                finally:
                    backend.close()
        except LaunchError as e:
            target["error"] = str(e)
            for cfg in workloads:
                report["workloads"].setdefault(cfg.name, {"config": cfg.to_dict(), "summary": describe(cfg),
                                                          "modes": {}})["modes"].setdefault(mode, {"runs": []})
                report["workloads"][cfg.name]["modes"][mode]["error"] = str(e).splitlines()[0]
            _log(f"[{mode}] {e}")
        save()


def _load() -> float | None:
    try:
        return round(os.getloadavg()[0], 2)
    except OSError:
        return None


def _clean(o):
    """JSON-safe copy: infinite rates become "inf" (strict JSON has no Infinity)."""
    if isinstance(o, dict):
        return {k: _clean(v) for k, v in o.items()}
    if isinstance(o, (list, tuple)):
        return [_clean(v) for v in o]
    if isinstance(o, float) and not math.isfinite(o):
        return "inf" if o > 0 else None
    return o


def _log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="benchmarks/serve.py")
    sub = parser.add_subparsers(dest="benchmark", required=True)
    add_parser(sub)
    args = parser.parse_args(["serve", *(sys.argv[1:] if argv is None else argv)])
    return int(args.func(args) or 0)
