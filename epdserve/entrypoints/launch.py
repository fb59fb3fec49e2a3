"""`epdserve launch`: one deployment mode on this machine — scheduler + instances as child processes.

    epdserve launch --mode EP-D --model DIR --prefill 2 --decode 2
    epdserve launch --config configs/E-P-D.yaml --model DIR      # flags override the file

Prints one line to stdout when every instance is on the scheduler's roster:
``epdserve ready: grpc://HOST:PORT mode=EP-D instances=EPx2,Dx2 mm_store=redis://...`` (then
``mm_store_password_file=PATH`` for the private MM Store — a 0600 file in the log directory
holding its random password, for `EPDSERVE_MM_STORE_PASSWORD` —, ``cluster_token_file=PATH``
when launch made the cluster token, ``tls=1`` with --tls-cert,
``http=URL`` with --http-port, and ``internal=grpc://HOST:PORT``: the scheduler's internal port).
--tls-cert/--tls-key put the scheduler's public ports on TLS, and the launcher's readiness probe
uses them too (as it uses EPDSERVE_API_KEY / EPDSERVE_CLUSTER_TOKEN); TLS flags passed through
--scheduler-args are honoured the same way. The HTTP API's model id is --served-model-name,
default --model as given. Every deployment has a cluster token (EPDSERVE_CLUSTER_TOKEN, else a
random one) that each child gets in its environment; a port beyond loopback with no credential
to refuse strangers stops the launch with the fix (--insecure: a lab, with a warning).
Ctrl-C / SIGTERM / SIGHUP stop every child (instances, then the scheduler, then the private MM
Store) and exit 0, within --drain-timeout + STOP_MARGIN_S seconds, always (past that it exits 1;
its children still go). Children also stop if the launcher is killed outright, SIGKILL included
(PR_SET_PDEATHSIG, and each child watches its parent's pid).
Child logs go to --log-dir (default: a temporary directory removed after a clean stop).
"""
from __future__ import annotations

import logging
import shlex
import signal
import sys
from pathlib import Path

from epdserve.commands import FlagsArg
from epdserve.deploy.argv import last_flag
from epdserve.security.exposure import INSECURE_HELP

log = logging.getLogger(__name__)

STOP_MARGIN_S = 20.0  # beyond --drain-timeout: the instances' own margin (5), the scheduler (5), the MM Store (5)

# Every launch option: its name (the argparse dest of `--<name with dashes>` and the YAML key,
# either spelling in YAML) → its default. An argparse default of None means "not on the command
# line": then the file's value, else this default, applies.
_DEFAULTS = {
    "mode": None, "model": None, "encode": 1, "prefill": 1, "decode": 1, "mm_store": None, "host": "127.0.0.1",
    "port": 0, "device": "cpu", "devices": [], "kv_cache_mb": None, "max_num_seqs": None, "block_size": None,
    "max_model_len": None, "feature_wait_s": None, "encode_token_budget": None, "colocation": None,
    "stream_interval_ms": None, "slo_tpot_ms": None, "instance_args": [],
    "scheduler_args": [], "log_dir": None,
    "ready_timeout_s": 600.0, "pin_instances": False, "drain_timeout": 10.0, "http_port": None,
    "restart_backoff_s": 0.5, "restart_backoff_max_s": 10.0, "max_restarts": 5, "mm_store_max_mb": 4096,
    "internal_port": None, "internal_host": None, "internal_tls_cert": None, "internal_tls_key": None,
    "internal_tls_ca": None, "expected_workload": None, "expected_rate": None, "profile": None,
    "tls_cert": None, "tls_key": None, "served_model_name": None, "insecure": False,
}
# options passed on to every `epdserve instance` as the flag of the same name (max_model_len also
# to the scheduler); left out, the instance's own default applies
_INSTANCE_FLAGS = ("kv_cache_mb", "max_num_seqs", "block_size", "max_model_len", "feature_wait_s",
                   "encode_token_budget", "colocation", "stream_interval_ms", "slo_tpot_ms")


def add_parser(subparsers):
    from epdserve.instance.colocation import POLICIES
    from epdserve.instance.roles import MODES

    p = subparsers.add_parser(
        "launch", help="launch a deployment mode (scheduler + instances) on this machine",
        description="Start the scheduler and the E/P/D instances of one deployment mode as child processes; "
                    "print where it serves; stop them all on Ctrl-C / SIGTERM.")
    p.add_argument("--config", type=Path, default=None, help="YAML file (configs/<mode>.yaml); flags override it")
    p.add_argument("--mode", choices=(*MODES, "auto"), default=None,
                   help="deployment mode; auto: the planner picks the mode and E:P:D split for "
                        "--expected-workload from a profile of the model, and the scheduler's controller moves "
                        "instances between roles as the traffic changes (experimental: on a 2-core CPU host it "
                        "ties P-D and made no switch, README 'Traffic that shifts, and --mode auto')")
    p.add_argument("--expected-workload", default=None,
                   help="auto: the traffic to plan the start for, a `bench serve` preset (default mixed)")
    p.add_argument("--expected-rate", type=float, default=None,
                   help="auto: its request rate (default: the preset's busier rate)")
    p.add_argument("--profile", default=None,
                   help="auto: an `epdserve profile` JSON of this model on this machine (default: measured once "
                        "and cached in ~/.cache/epdserve/profiles)")
    p.add_argument("--model", default=None, help="checkpoint directory")
    p.add_argument("--encode", type=int, default=None,
                   help="E workers (default 1): in EP-D / ED-P the co-located ones count and the rest are E-only "
                        "instances; monolithic ignores it")
    p.add_argument("--prefill", type=int, default=None, help="P instances (EP / PD / EPD instances in those modes)")
    p.add_argument("--decode", type=int, default=None, help="D instances (ED instances in ED-P)")
    p.add_argument("--mm-store", default=None, help="redis://host:port of the MM Store (default: a private local server)")
    p.add_argument("--mm-store-max-mb", type=int, default=None,
                   help="memory bound of the private MM Store server, least recently used features evicted "
                        "(MiB, default 4096)")
    p.add_argument("--host", default=None, help="address the scheduler binds and instances advertise (default 127.0.0.1)")
    p.add_argument("--port", type=int, default=None, help="scheduler's public port (default 0: a free port)")
    p.add_argument("--device", default=None, help="cpu | cuda | npu (default cpu)")
    p.add_argument("--devices", default=None,
                   help="accelerator ids handed to instances round-robin, e.g. 0,1,2,3 "
                        "(default: every visible device, one per instance)")
    p.add_argument("--pin-instances", action="store_true", default=None,
                   help="CPU: give each instance a disjoint share of the cores (default: all share them)")
    p.add_argument("--kv-cache-mb", type=int, default=None, help="KV cache per P/D worker (MiB)")
    p.add_argument("--max-num-seqs", type=int, default=None)
    p.add_argument("--block-size", type=int, default=None)
    p.add_argument("--max-model-len", type=int, default=None)
    p.add_argument("--feature-wait-s", type=float, default=None, help="P: wait for E's features, then recompute")
    p.add_argument("--encode-token-budget", type=int, default=None,
                   help="E: vision tokens encoded per engine step, across requests (default 1024); a long video "
                        "is encoded over several steps (see `epdserve instance --help`)")
    p.add_argument("--colocation", choices=POLICIES, default=None,
                   help="how stages share the cores: split (fixed shares inside an instance, the default), yield "
                        "(all cores, E at the lowest priority) or slo (all cores, one stage at a time in SLO order: "
                        "on CPU the launcher runs one core-lease arbiter for every instance; experimental: 0.31-0.37x "
                        "monolithic's goodput for EP-D, E-P-D, ED-P on a 2-core CPU host, README 'Co-location "
                        "policy'); see "
                        "`epdserve instance --help`")
    p.add_argument("--slo-tpot-ms", type=float, default=None,
                   help="slo: the TPOT SLO decode steps are paced to keep (default 100 ms)")
    p.add_argument("--stream-interval-ms", type=float, default=None,
                   help="gather a request's tokens after its first for up to this long into one stream message "
                        "(default 0: at once)")
    p.add_argument("--instance-args", action=FlagsArg, default=None,
                   help="extra `epdserve instance` flags, one string (may start with --)")
    p.add_argument("--scheduler-args", action=FlagsArg, default=None,
                   help="extra `epdserve scheduler` flags, one string (may start with --), e.g. "
                        "--scheduler-args \"--allow-remote-images\"; they override launch's own")
    p.add_argument("--log-dir", default=None, help="where child logs go (kept); default: a temp dir")
    p.add_argument("--ready-timeout-s", type=float, default=None, help="give up starting after this long (600)")
    p.add_argument("--http-port", type=int, default=None,
                   help="the scheduler also serves the OpenAI-compatible HTTP API here (0: a free one, printed as "
                        "http=URL in the ready line); the API key, if any, comes from EPDSERVE_API_KEY")
    p.add_argument("--served-model-name", default=None,
                   help="the model id the HTTP API lists in /v1/models and accepts in requests (default: --model "
                        "as given)")
    p.add_argument("--tls-cert", default=None,
                   help="PEM certificate: the scheduler serves its public gRPC and HTTP ports over TLS; the "
                        "launcher's readiness probe trusts it (self-signed, or a chain file ending with its CA)")
    p.add_argument("--tls-key", default=None, help="PEM private key of --tls-cert")
    _add_internal_flags(p)
    p.add_argument("--drain-timeout", type=float, default=None,
                   help="on stop, instances let calls in flight finish for up to this many seconds (default 10); "
                        f"the launcher exits within this + {STOP_MARGIN_S:.0f} s, always")
    p.add_argument("--restart-backoff-s", type=float, default=None,
                   help="a dead child (instance, scheduler, MM Store server) is started again after this "
                        "(default 0.5), doubling with each exit in a row")
    p.add_argument("--restart-backoff-max-s", type=float, default=None, help="cap of that backoff (default 10)")
    p.add_argument("--max-restarts", type=int, default=None,
                   help="exits in a row (each within 60 s of its start) before a child counts as crash-looping "
                        "and is left dead (default 5; the scheduler's ends the deployment)")
    p.set_defaults(func=run)
    return p


def _add_internal_flags(p) -> None:
    g = p.add_argument_group(
        "internal port (scheduler <-> instances)",
        "The Registry is never on the public --port. The cluster token comes from EPDSERVE_CLUSTER_TOKEN, else "
        "launch makes a random one; every child gets it in its environment: instances present it to register "
        "and the scheduler on every call to them.")
    g.add_argument("--internal-port", type=int, default=None,
                   help="the port of the scheduler's instance Registry (default: a free one); instances register "
                        "there")
    g.add_argument("--internal-host", default=None,
                   help="interface of --internal-port, e.g. this machine's cluster-network address (default --host); "
                        "instances dial it (--host when it is 0.0.0.0 / ::)")
    g.add_argument("--internal-tls-cert", default=None,
                   help="mutual TLS between scheduler and instances: the PEM certificate "
                        "the scheduler and every instance present (its SAN must name --host)")
    g.add_argument("--internal-tls-key", default=None, help="PEM private key of --internal-tls-cert")
    g.add_argument("--insecure", action="store_true", default=None, help=INSECURE_HELP)
    g.add_argument("--internal-tls-ca", default=None,
                   help="PEM CA both sides trust: the Registry and the instances' ports refuse a peer whose "
                        "certificate does not chain to it")


def _internal(merged: dict, args) -> tuple[list[str], list[str], str]:
    """(scheduler flags, instance flags, the Registry's host:port): the Registry is always on an
    internal port of its own (never the public one), --internal-port or a free one."""
    tls = [merged[k] for k in ("internal_tls_cert", "internal_tls_key", "internal_tls_ca")]
    if any(tls) and not all(tls):
        raise ValueError("--internal-tls-cert, --internal-tls-key and --internal-tls-ca go together")
    from epdserve.net import free_port

    bind = merged["internal_host"] or merged["host"]
    # resolved now: a restarted scheduler comes back on the same port, where instances look for it
    port = int(merged["internal_port"] or 0) or free_port("0.0.0.0" if bind in ("0.0.0.0", "::") else bind)
    sched = ["--internal-port", str(port), "--internal-host", bind]
    inst = []
    if all(tls):
        cert, key, ca = (str(Path(x).expanduser().resolve()) for x in tls)
        sched += ["--internal-tls-cert", cert, "--internal-tls-key", key, "--internal-tls-ca", ca]
        inst += ["--tls-cert", cert, "--tls-key", key, "--tls-ca", ca]
    dial = merged["host"] if bind in ("0.0.0.0", "::") else bind
    return sched, inst, f"[{dial}]:{port}" if ":" in dial else f"{dial}:{port}"


def _served_name(merged: dict) -> list[str]:
    """--served-model-name for the scheduler: the model id of the HTTP API, by default --model as
    given (the scheduler's own default is the path it is handed, which may be spelled otherwise)."""
    name = str(merged["served_model_name"] or merged["model"])
    return [] if name == str(Path(merged["model"]).expanduser()) else ["--served-model-name", name]


def _tls(merged: dict) -> list[str]:
    """The scheduler's public TLS flags (absolute paths: children start in another directory)."""
    cert, key = merged["tls_cert"], merged["tls_key"]
    if bool(cert) != bool(key):
        raise ValueError("--tls-cert and --tls-key go together")
    if not cert:
        return []
    cert, key = (str(Path(x).expanduser().resolve()) for x in (cert, key))
    for what, path in (("--tls-cert", cert), ("--tls-key", key)):
        if not Path(path).is_file():
            raise ValueError(f"{what} {path}: no such file")
    return ["--tls-cert", cert, "--tls-key", key]


def load_config(path: Path | None) -> dict:
    if path is None:
        return {}
    import yaml

    data = yaml.safe_load(Path(path).read_text()) or {}
    if not isinstance(data, dict):
        raise ValueError(f"{path}: expected a mapping of launch options")
    data = {str(k).replace("-", "_"): v for k, v in data.items()}
    unknown = sorted(set(data) - set(_DEFAULTS))
    if unknown:
        raise ValueError(f"{path}: unknown option(s) {', '.join(unknown)}; known: {', '.join(sorted(_DEFAULTS))}")
    return data


def _flags(v) -> list[str]:
    """Extra command-line flags: one string (shell-split) or a list."""
    return shlex.split(v) if isinstance(v, str) else [str(x) for x in v or []]


def _ids(v) -> list[str]:
    """Device ids: "0,1,2" or a list."""
    if isinstance(v, (int, str)):
        return [x.strip() for x in str(v).split(",") if x.strip()]
    return [str(x) for x in v or []]


def spec_from_args(args):
    from epdserve.deploy.deployment import DeploymentSpec
    from epdserve.deploy.supervisor import RestartPolicy

    file = load_config(args.config)
    merged = {}
    for key, default in _DEFAULTS.items():
        cli = getattr(args, key, None)
        merged[key] = cli if cli is not None else file.get(key, default)
    if not merged["mode"]:
        raise ValueError("--mode is required (or `mode:` in --config)")
    if not merged["model"]:
        raise ValueError("--model is required (or `model:` in --config)")
    inst = _flags(merged["instance_args"])
    for key in _INSTANCE_FLAGS:
        if merged[key] is not None:
            inst += [f"--{key.replace('_', '-')}", str(merged[key])]
    # launch's own scheduler flags first: --scheduler-args come after them and win (argparse: the last one)
    sched = [*_served_name(merged), *_tls(merged), *_flags(merged["scheduler_args"])]
    if merged["max_model_len"] is not None:
        sched += ["--max-model-len", str(merged["max_model_len"])]
    if merged["http_port"] is not None:  # resolved now: a restarted scheduler comes back on the same port
        from epdserve.net import free_port

        args.http_port = int(merged["http_port"]) or free_port(merged["host"])
        sched += ["--http-port", str(args.http_port)]
    planned = None
    if merged["mode"] == "auto":
        merged, planned = _plan_auto(merged)
        sched += ["--controller"]
    if merged["insecure"]:
        sched += ["--insecure"]
        inst += ["--insecure"]
    internal_sched, internal_inst, registry = _internal(merged, args)
    sched += internal_sched
    inst += internal_inst
    return DeploymentSpec(
        mode=merged["mode"], model=str(Path(merged["model"]).expanduser()), encode=int(merged["encode"]),
        prefill=int(merged["prefill"]), decode=int(merged["decode"]), mm_store=merged["mm_store"],
        host=merged["host"], port=int(merged["port"]), device=merged["device"],
        devices=_ids(merged["devices"]), instance_args=inst, scheduler_args=sched,
        registry=registry, planned=planned, pin_instances=bool(merged["pin_instances"]), log_dir=merged["log_dir"], log_level=getattr(args, "log_level", "INFO"),
        ready_timeout_s=float(merged["ready_timeout_s"]), drain_timeout_s=float(merged["drain_timeout"]),
        mm_store_max_bytes=int(merged["mm_store_max_mb"]) << 20,
        restart=RestartPolicy(first_backoff_s=float(merged["restart_backoff_s"]),
                              max_backoff_s=float(merged["restart_backoff_max_s"]),
                              max_restarts=int(merged["max_restarts"])),
    )


def _plan_auto(merged: dict) -> tuple[dict, str]:
    """--mode auto: the planner's starting deployment (planner/auto.py) in place of the mode and counts."""
    from epdserve.planner.auto import DEFAULT_WORKLOAD, plan_start

    devices = len(_ids(merged["devices"])) or 2
    plan = plan_start(str(Path(merged["model"]).expanduser()), merged["device"], merged["profile"],
                      merged["expected_workload"] or DEFAULT_WORKLOAD, merged["expected_rate"], devices)
    return {**merged, "mode": plan.mode, "encode": plan.encode, "prefill": plan.prefill,
            "decode": plan.decode}, plan.line()


def ready_line(dep, address: str, http_port: int | None) -> str:
    """``epdserve ready: ...``: where the deployment serves, and where the private MM Store's
    password file is (the password itself never goes to stdout)."""
    spec = dep.spec
    tls = last_flag(spec.scheduler_args, "--tls-cert") is not None
    line = (f"epdserve ready: grpc://{address} mode={spec.mode}{' auto=1' if spec.planned else ''} "
            f"instances={dep.summary()} mm_store={dep.mm_store_url}")
    if dep.mm_store_password_file is not None:
        line += f" mm_store_password_file={dep.mm_store_password_file}"
    if dep.cluster_token_file is not None:
        line += f" cluster_token_file={dep.cluster_token_file}"
    if tls:
        line += " tls=1"
    if http_port:
        line += f" http={'https' if tls else 'http'}://{spec.host}:{http_port}"
    if spec.registry:
        line += f" internal=grpc://{spec.registry}"
    return line


def run(args) -> int:
    from epdserve.deploy.deployment import Deployment, LaunchError

    try:
        spec = spec_from_args(args)
        dep = Deployment(spec)
    except (ValueError, OSError) as e:
        log.error("%s", e)
        return 2
    from epdserve.deploy.signals import StopSignals

    stop = StopSignals((signal.SIGTERM, signal.SIGINT, signal.SIGHUP), deadline_s=spec.drain_timeout_s + STOP_MARGIN_S,
                       name="launch").install()
    clean = False
    try:
        if spec.planned:
            log.info("auto: %s", spec.planned)
        log.info("starting mode %s (%s); child logs in %s", spec.mode, dep.summary(), dep.log_dir)
        address = dep.start(should_stop=stop.is_set)
        print(ready_line(dep, address, getattr(args, "http_port", None)), flush=True)
        while not stop.wait(0.5):
            reason = dep.watch()
            if reason:
                log.error("stopping: %s", reason)
                return 1
        clean = True
        return 0
    except KeyboardInterrupt:  # a signal arrived while starting
        clean = True
        return 0
    except (LaunchError, OSError) as e:
        log.error("launch failed: %s", e)
        return 1
    finally:
        dep.stop(clean=clean)
        stop.stopped()
        print("epdserve stopped", file=sys.stderr, flush=True)
