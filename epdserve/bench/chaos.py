"""`epdserve bench chaos`: what faults cost a launched deployment under steady load.

Launches one mode (default E-P-D with 2 instances per role), runs a calm pass of a mixed
workload (text-only prompts and prompts with images; greedy), then keeps `--concurrency`
clients looping over the same workload while it SIGKILLs, one after the other
(`--fault-interval-s` apart, each once the previous one is repaired), one instance of each role,
the MM Store server and the scheduler (`--faults`); `epdserve launch` restarts each one.
Clients resume requests whose scheduler died (`Client(retry_deadline_s=...)`).

Reported (a Markdown table on stdout, everything in `--out` JSON): requests served, lost (an
error reached the client) and resumed by the client; greedy outputs that differ from the calm
pass; end-to-end latency p50 / p99 before the first fault, during each fault (requests started
between the kill and the repair) and after the last one; per fault, the seconds until the
process ran again and until the scheduler's roster was whole again; and, after the deployment
is stopped, any process or listening port of it left behind. Exit code 1 if anything was lost,
mismatched, not back within `--back-timeout-s`, or left behind.

`--requests-out FILE` also writes every request of the load as JSON Lines, so a checker can count
and compare them itself instead of trusting the counters above: `{"id", "client", "prompt",
"event": "sent"}` before the request is sent, then `{"id", "event": "answered", "token_ids"}` or
`{"id", "event": "error", "error"}` (an unexpected exception in a client thread included).
"""
from __future__ import annotations

import json
import os
import secrets
import shlex
import sys
import threading
import time
from dataclasses import asdict, dataclass, field

from epdserve.bench import chaos_faults as faults
from epdserve.commands import add_command
from epdserve.perf.serving_metrics import stats
from epdserve.security.secrets import CLUSTER_TOKEN_ENV

DEFAULT_FAULTS = "E,P,D,mm_store,scheduler"


def add_parser(subparsers):
    p = add_command(subparsers, "chaos", run, "kill -9 instances, MM Store and scheduler under load; report losses",
                    __doc__)
    p.add_argument("--model", metavar="DIR", help="checkpoint (default: the small demo model, built once)")
    p.add_argument("--mode", default="E-P-D", help="deployment mode")
    p.add_argument("--per-role", type=int, default=2, help="instances of each role")
    p.add_argument("--faults", default=DEFAULT_FAULTS,
                   help=f"what to kill, in order: roles (E, P, D, EP, ...), mm_store, scheduler (default {DEFAULT_FAULTS})")
    p.add_argument("--concurrency", type=int, default=4, help="clients looping over the workload")
    p.add_argument("--prompts", type=int, default=8, help="workload size; every second prompt has an image")
    p.add_argument("--max-tokens", type=int, default=16, help="output tokens per request")
    p.add_argument("--warmup-s", type=float, default=5.0, help="load before the first fault")
    p.add_argument("--fault-interval-s", type=float, default=5.0,
                   help="load between one fault's repair and the next fault")
    p.add_argument("--back-timeout-s", type=float, default=60.0, help="a fault not repaired by then fails the run")
    p.add_argument("--client-retry-deadline-s", type=float, default=None,
                   help="how long a client keeps resuming a request whose scheduler is lost, from the first "
                        "failure in a row (default: the client's, RetryPolicy.deadline_s = 60)")
    p.add_argument("--launch-args", default="--kv-cache-mb 32 --drain-timeout 2 --restart-backoff-s 0.2",
                   help="extra `epdserve launch` flags (one string)")
    p.add_argument("--out", default="chaos.json", help="JSON report")
    p.add_argument("--requests-out", metavar="FILE", default=None,
                   help="also write each request of the load (sent, then answered with its token ids or its "
                        "error) as JSON Lines, for an independent check (default: not written)")
    return p


@dataclass
class Outcome:
    prompt: int
    t0: float
    t1: float
    error: str = ""  # the status code name when the request was lost
    mismatch: bool = False


@dataclass
class Fault:
    target: str
    pid: int
    t: float  # seconds since the load started
    process_s: float | None = None
    roster_s: float | None = None


@dataclass
class Report:
    mode: str
    served: int = 0
    lost: int = 0
    resumed: int = 0
    mismatched: int = 0
    latency_ms: dict = field(default_factory=dict)  # window -> {p50, p99, count}
    faults: list = field(default_factory=list)
    back_within_s: float | None = None
    left_processes: list = field(default_factory=list)
    left_ports: list = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return (not self.lost and not self.mismatched and not self.left_processes and not self.left_ports
                and all(f["roster_s"] is not None for f in self.faults))


def workload(n: int) -> list[tuple[str, list[bytes]]]:
    from epdserve.model.demo_images import jpeg_bytes, procedural_image

    ph = "<|vision_start|><|image_pad|><|vision_end|>"
    out = []
    for i in range(n):
        if i % 2:
            out.append((f"Request {i}: describe {ph} briefly.", [jpeg_bytes(procedural_image(56 + 28 * (i % 3), 56,
                                                                                             seed=100 + i))]))
        else:
            out.append((f"Request {i}: say something about the number {i}.", []))
    return out


class Load:
    """`concurrency` client threads looping over the workload until `stop()`; each request's outcome."""

    def __init__(self, address: str, work, calm: list[list[int]], args, journal=None):
        """`journal`: a text file each request is written to (see the module docstring), or None."""
        self.address, self.work, self.calm, self.args = address, work, calm, args
        self.journal = journal
        self._ids = iter(range(1 << 62))
        self.outcomes: list[Outcome] = []
        self.resumed = 0
        self.t_start = time.monotonic()
        self._stop = threading.Event()
        self._lock = threading.Lock()
        self._threads = [threading.Thread(target=self._loop, args=(k,), daemon=True) for k in range(args.concurrency)]

    def start(self) -> "Load":
        for t in self._threads:
            t.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        for t in self._threads:
            t.join()

    def _write(self, **record) -> None:
        if self.journal is not None:
            with self._lock:
                self.journal.write(json.dumps(record) + "\n")
                self.journal.flush()

    def _loop(self, k: int) -> None:
        from epdserve.client import Client, EPDServeError

        deadline = self.args.client_retry_deadline_s
        with Client(self.address, timeout=300, **({} if deadline is None else {"retry_deadline_s": deadline})) as c:
            i = k
            while not self._stop.is_set():
                j = i % len(self.work)
                prompt, images = self.work[j]
                with self._lock:
                    rid = next(self._ids)
                self._write(id=rid, client=k, prompt=j, event="sent")
                t0 = time.monotonic()
                try:
                    r = c.generate(prompt, images=images, max_tokens=self.args.max_tokens, ignore_eos=True)
                    o = Outcome(j, t0, time.monotonic(), mismatch=r.token_ids != self.calm[j])
                    self._write(id=rid, event="answered", token_ids=list(r.token_ids))
                except EPDServeError as e:
                    o = Outcome(j, t0, time.monotonic(), error=e.code.name)
                    self._write(id=rid, event="error", error=e.code.name)
                except Exception as e:  # counted as lost, never a silently dead client thread
                    o = Outcome(j, t0, time.monotonic(), error=type(e).__name__)
                    self._write(id=rid, event="error", error=f"{type(e).__name__}: {e}")
                with self._lock:
                    self.outcomes.append(o)
                i += self.args.concurrency
            with self._lock:
                self.resumed += c.retried


def _latency(outcomes: list[Outcome], lo: float, hi: float) -> dict:
    s = stats([o.t1 - o.t0 for o in outcomes if lo <= o.t0 < hi and not o.error])
    return {"count": s["count"], "p50": s["median"], "p99": s["p99"]}


def chaos(address: str, launcher_pid: int, args, cluster_token: str, journal=None
          ) -> tuple[Report, set[int], set]:
    from epdserve.client import Client

    work = workload(args.prompts)
    with Client(address, timeout=300) as c:
        calm = [c.generate(p, images=im, max_tokens=args.max_tokens, ignore_eos=True).token_ids for p, im in work]
        instances = sum(1 for i in c.server_info().instances if i.health == 1)
    seen_pids = {p.pid for _, p in faults.children(launcher_pid)} | {launcher_pid}
    seen_ports = faults.listening_ports([p for _, p in faults.children(launcher_pid)])
    rep = Report(args.mode)
    load = Load(address, work, calm, args, journal).start()
    time.sleep(args.warmup_s)
    for target in [t.strip() for t in args.faults.split(",") if t.strip()]:
        victim = faults.pick(launcher_pid, target)
        if victim is None:
            raise SystemExit(f"no process to kill for fault {target!r}")
        kids = faults.children(launcher_pid)
        kind = next(k for k, p in kids if p.pid == victim.pid)
        before = {p.pid for k, p in kids if k == kind}
        t = time.monotonic()
        faults.kill(victim)
        f = Fault(target, victim.pid, t - load.t_start)
        back = faults.wait_back(launcher_pid, address, cluster_token, kind, before, instances, t,
                                args.back_timeout_s)
        if back is not None:
            f.process_s, f.roster_s = back.process_s, back.roster_s
        rep.faults.append(asdict(f))
        kids = [p for _, p in faults.children(launcher_pid)]
        seen_pids |= {p.pid for p in kids}
        seen_ports |= faults.listening_ports(kids)
        print(f"chaos: killed {target} (pid {victim.pid}); back in "
              f"{'-' if f.roster_s is None else f'{f.roster_s:.1f}'} s", file=sys.stderr, flush=True)
        time.sleep(args.fault_interval_s)
    load.stop()
    outs = load.outcomes
    rep.served = sum(1 for o in outs if not o.error)
    rep.lost = sum(1 for o in outs if o.error)
    rep.mismatched = sum(1 for o in outs if o.mismatch)
    rep.resumed = load.resumed
    edges = [(f["target"], load.t_start + f["t"], load.t_start + f["t"] + (f["roster_s"] or args.back_timeout_s))
             for f in rep.faults]
    first = edges[0][1] if edges else float("inf")
    rep.latency_ms["before"] = _latency(outs, 0.0, first)
    for target, lo, hi in edges:
        rep.latency_ms[f"during {target}"] = _latency(outs, lo, hi)
    rep.latency_ms["after"] = _latency(outs, edges[-1][2] if edges else first, float("inf"))
    backs = [f["roster_s"] for f in rep.faults if f["roster_s"] is not None]
    rep.back_within_s = max(backs) if backs else None
    return rep, seen_pids, seen_ports


def markdown(rep: Report) -> str:
    lines = [f"### chaos: {rep.mode}", "",
             f"served {rep.served}, lost {rep.lost}, resumed by the client {rep.resumed}, "
             f"greedy mismatches {rep.mismatched}; every fault repaired within "
             f"{'-' if rep.back_within_s is None else f'{rep.back_within_s:.1f}'} s; "
             f"left behind: {len(rep.left_processes)} processes, {len(rep.left_ports)} ports", "",
             "| window | requests | p50 ms | p99 ms | process back s | roster whole s |",
             "|---|---:|---:|---:|---:|---:|"]
    by_target = {f"during {f['target']}": f for f in rep.faults}

    def num(x, nd=0):
        return "-" if x is None else f"{x:.{nd}f}"

    for window, s in rep.latency_ms.items():
        f = by_target.get(window, {})
        lines.append(f"| {window} | {s['count']} | {num(s['p50'])} | {num(s['p99'])} | "
                     f"{num(f.get('process_s'), 1)} | {num(f.get('roster_s'), 1)} |")
    return "\n".join(lines)


def run(args) -> int:
    from epdserve.deploy.local.launched import launched

    model = args.model
    if model is None:
        from epdserve.bench.offline import default_model

        model = str(default_model("qwen2_vl"))
    n = str(args.per_role)
    extra = ["--encode", n, "--prefill", n, "--decode", n, *shlex.split(args.launch_args)]
    # the deployment's cluster token, known here: the roster's pids are shown only to its holders
    token = os.environ.get(CLUSTER_TOKEN_ENV) or secrets.token_urlsafe(32)
    with launched(args.mode, model, extra_args=extra, ready_timeout_s=600, stop_timeout_s=60,
                  env={CLUSTER_TOKEN_ENV: token}) as dep, \
            open(args.requests_out or os.devnull, "w") as journal:
        rep, pids, ports = chaos(dep.address, dep.pid, args, token, journal if args.requests_out else None)
    rep.left_processes, rep.left_ports = faults.leftovers(pids, ports, within_s=10.0)
    with open(args.out, "w") as f:
        json.dump({**asdict(rep), "ok": rep.ok}, f, indent=2)
    print(markdown(rep))
    return 0 if rep.ok else 1
