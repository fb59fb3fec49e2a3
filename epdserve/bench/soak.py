"""`epdserve bench soak`: N minutes of mixed traffic across a launched E-P-D deployment, one
instance SIGKILLed every K minutes; is anything lost, does any output change, does memory grow?

Steps: the catalogue's expected outputs from the offline engine (bench/soak_traffic.py: text,
images, video, n = 2, json_schema / json_object, upload-then-ask, multi-turn prefix reuse, sampled
json_object), computed before the deployment starts; `epdserve launch --mode E-P-D` with
`--per-role` instances of each role and the OpenAI HTTP front on (deploy/local/launched.py); a
warm-up (each item once, one at a time); the RSS of every process (bench/soak_rss.py); then
`--concurrency` clients loop over the catalogue for `--minutes` while one instance is killed every
`--kill-every-min` minutes, E, P, D in turn, the launcher's supervisor restarting it
(bench/soak_load.py); the RSS again at the end, before the deployment stops.

Reported (bench/soak_report.py), to `--out` (JSON) and the same path with `.md` (and stdout):
requests sent / answered / lost per kind (lost: never answered with a success after the client's
own retry policy: soak_traffic.LOST_DEFINITION), greedy outputs that differ from the offline engine
token for token, sampled grammar replies that are not JSON, each kill with its recovery delays,
and every process's RSS after the warm-up and at the end. Aims: 0 lost, 0 differing, RSS within
+10 % (reported, not asserted). Exit code 1 if a request was lost, an output differed, a sampled
reply was invalid JSON or a killed instance was not back within `--back-timeout-s`.
"""
from __future__ import annotations

import datetime
import json
import os
import secrets
import shlex
import subprocess
import sys
import time
from pathlib import Path

from epdserve.commands import add_command
from epdserve.security.secrets import CLUSTER_TOKEN_ENV

DEFAULT_LAUNCH_ARGS = "--kv-cache-mb 32 --drain-timeout 2 --restart-backoff-s 0.2 --http-port 0"


def add_parser(subparsers):
    p = add_command(subparsers, "soak", run, "minutes of mixed traffic on E-P-D with instances killed: "
                                              "losses, outputs vs offline, RSS growth", __doc__)
    p.add_argument("--model", metavar="DIR", help="checkpoint (default: the tiny demo model, built once)")
    p.add_argument("--minutes", type=float, default=30.0, help="length of the load")
    p.add_argument("--kill-every-min", type=float, default=5.0,
                   help="one instance SIGKILLed every this many minutes of load")
    p.add_argument("--kill-roles", default="E,P,D", help="the roles killed in turn (default E,P,D; empty: none)")
    p.add_argument("--per-role", type=int, default=2, help="instances of each role")
    p.add_argument("--concurrency", type=int, default=4, help="clients looping over the catalogue")
    p.add_argument("--max-tokens", type=int, default=12, help="output tokens of each greedy request")
    p.add_argument("--sampled-max-tokens", type=int, default=48,
                   help="output tokens of the sampled json_object requests")
    p.add_argument("--back-timeout-s", type=float, default=300.0,
                   help="a killed instance not back (roster whole) by then counts as not repaired; the next kill "
                        "waits for it (default 300)")
    p.add_argument("--launch-args", default=DEFAULT_LAUNCH_ARGS,
                   help=f"extra `epdserve launch` flags, one string (default {DEFAULT_LAUNCH_ARGS!r})")
    p.add_argument("--out", default="soak.json", help="JSON report; the Markdown summary goes beside it (.md)")
    return p


def _commit() -> str:
    try:
        return subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, timeout=10,
                              cwd=Path(__file__).resolve().parent).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return ""


def _command() -> str:
    argv = sys.argv[1:]
    if argv[:2] == ["bench", "soak"]:
        return shlex.join(["epdserve", *argv])
    return "(run from Python: " + shlex.join([os.path.basename(sys.argv[0]), *argv]) + ")"


def soak(dep, token: str, items, expected, args) -> dict:
    """The warm-up, the readings and the load with its kills, on a launched deployment `dep`."""
    from epdserve.bench.soak_load import SoakLoad, kill_rotation
    from epdserve.bench.soak_report import tally
    from epdserve.bench.soak_rss import rss_snapshot, rss_table
    from epdserve.bench.soak_traffic import send
    from epdserve.client import Client

    with Client(dep.address, timeout=300) as c:
        warm = [send(c, it, seed=0) for it in items]
        instances = sum(1 for i in c.server_info().instances if i.health == 1)
    rss_start = rss_snapshot(dep.pid)
    load_avg_start = os.getloadavg()
    load = SoakLoad(dep.address, items, args.concurrency).start()
    roles = [r.strip() for r in args.kill_roles.split(",") if r.strip()]
    try:
        kills = kill_rotation(dep.pid, dep.address, token, instances, roles, 60.0 * args.kill_every_min,
                              load.t_start + 60.0 * args.minutes, load.t_start, args.back_timeout_s)
    finally:
        sent = load.stop()
    load_s = time.monotonic() - load.t_start
    rss_end = rss_snapshot(dep.pid)
    load_avg = {"start": [round(x, 2) for x in load_avg_start], "end": [round(x, 2) for x in os.getloadavg()]}
    return {"warmup": {k: v for k, v in tally(warm, expected).items() if k != "by_kind"},
            "requests": tally(sent, expected), "load_s": round(load_s, 1), "instances": instances,
            "machine": {"cpus": os.cpu_count(), "load_avg_1_5_15m": load_avg},
            "kills": [k.to_dict() for k in kills],
            "rss": [row.to_dict() for row in rss_table(rss_start, rss_end)]}


def run(args) -> int:
    from epdserve.deploy.local.launched import launched
    from epdserve.bench.soak_report import markdown
    from epdserve.bench.soak_traffic import LOST_DEFINITION, catalogue, expected_outputs

    model = args.model
    if model is None:
        from epdserve.bench.offline import default_model

        model = str(default_model("qwen2_vl", "tiny"))
    date = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M")
    items, expected = expected_outputs(model, catalogue(args.max_tokens, args.sampled_max_tokens))
    n = str(args.per_role)
    extra = ["--encode", n, "--prefill", n, "--decode", n, *shlex.split(args.launch_args)]
    token = os.environ.get(CLUSTER_TOKEN_ENV) or secrets.token_urlsafe(32)
    with launched("E-P-D", model, extra_args=extra, ready_timeout_s=600, stop_timeout_s=60,
                  env={CLUSTER_TOKEN_ENV: token}) as dep:
        body = soak(dep, token, items, expected, args)
    rep = {"command": _command(), "date": date, "commit": _commit(),
           "config": {"mode": "E-P-D", "model": model, "per_role": args.per_role, "duration_s": 60.0 * args.minutes,
                      "kill_every_s": 60.0 * args.kill_every_min, "kill_roles": args.kill_roles,
                      "concurrency": args.concurrency, "max_tokens": args.max_tokens,
                      "sampled_max_tokens": args.sampled_max_tokens, "launch_args": args.launch_args,
                      "catalogue": [it.name for it in items]},
           "lost_definition": LOST_DEFINITION, **body}
    r = rep["requests"]
    rep["ok"] = (not r["lost"] and not r["differing"] and not r["sampled_json"]["invalid_json"]
                 and all(k["roster_s"] is not None for k in rep["kills"]))
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(rep, indent=1) + "\n")
    md = markdown(rep)
    out.with_suffix(".md").write_text(md)
    print(md)
    return 0 if rep["ok"] else 1
