"""`epdserve launch`: one deployment mode on this machine — scheduler + instances as child processes.

    epdserve launch --mode EP-D --model DIR --prefill 2 --decode 2
    epdserve launch --config configs/E-P-D.yaml --model DIR      # flags override the file
    epdserve launch --mode EP-D                                  # the built-in random-weight demo checkpoint

Prints one line to stdout when every instance is on the scheduler's roster:
``epdserve ready: grpc://HOST:PORT mode=EP-D instances=EPx2,Dx2 kv_hop=device mm_store=redis://...``
(``kv_hop=``: the P->D KV hop, `deploy/kv_hop.py`, in modes that have one; then
``mm_store_password_file=PATH`` for the private MM Store — a 0600 file in the log directory
holding its random password, for `EPDSERVE_MM_STORE_PASSWORD` —, ``cluster_token_file=PATH``
when launch made the cluster token, ``media_key_secret_file=PATH`` when it made the media-key
secret (`EPDSERVE_MEDIA_KEY_SECRET`: the scheduler keys media with it), ``tls=1`` with --tls-cert,
``http=URL`` with --http-port, ``internal=grpc://HOST:PORT``: the scheduler's internal port, and,
without --model, ``model=PATH (the built-in demo: random weights, ...)``: launch serves a tiny
random-weight Qwen2-VL built once into the user's cache, model/demo_cache.py).
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

from epdserve.deploy.local.argv import last_flag
from epdserve.entrypoints.launch_settings import (STOP_MARGIN_S, add_launch_flags, instance_argv, merged_options,
                                                  option_choices, option_defaults, scheduler_argv, slo_of)

log = logging.getLogger(__name__)



def add_parser(subparsers):
    p = subparsers.add_parser(
        "launch", help="launch a deployment mode (scheduler + instances) on this machine",
        description="Start the scheduler and the E/P/D instances of one deployment mode as child processes; "
                    "print where it serves; stop them all on Ctrl-C / SIGTERM.")
    add_launch_flags(p)
    p.set_defaults(func=run)
    return p


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
    known = option_defaults()
    unknown = sorted(set(data) - set(known))
    if unknown:
        raise ValueError(f"{path}: unknown option(s) {', '.join(unknown)}; known: {', '.join(sorted(known))}")
    for key, allowed in option_choices().items():
        if key in data and data[key] is not None and data[key] not in allowed:
            raise ValueError(f"{path}: {key}: {data[key]!r} is not one of {', '.join(map(str, allowed))}")
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
    from epdserve.deploy.local.deployment import DeploymentSpec
    from epdserve.deploy.local.supervisor import RestartPolicy

    merged = merged_options(args, load_config(getattr(args, "config", None)))
    if not merged["mode"]:
        raise ValueError("--mode is required (or `mode:` in --config)")
    demo = not merged["model"]
    if demo:  # the built-in random-weight checkpoint (model/demo_cache.py), built once
        from epdserve.model.demo_cache import cached_demo_model

        merged["model"] = str(cached_demo_model())
    inst = [*_flags(merged["instance_args"]), *instance_argv(merged)]
    # launch's own scheduler flags first: --scheduler-args come after them and win (argparse: the last one)
    sched = [*_served_name(merged), *scheduler_argv(merged), *_tls(merged), *_flags(merged["scheduler_args"])]
    http_port = -1 if merged["http_port"] is None else int(merged["http_port"])  # a config's null: no front
    if http_port < -1:
        raise ValueError(f"--http-port must be a port, 0 (a free one) or -1 (no HTTP front), got {http_port}")
    if http_port >= 0:  # the OpenAI front, by default
        # 0: the scheduler binds a free port itself; a restarted one comes back on it (deploy/local/deployment.py)
        sched += ["--http-port", str(http_port)]
    from epdserve.platform import resolve_device

    merged["device"] = resolve_device(merged["device"])  # auto: the platform this machine has
    planned = None
    if merged["mode"] == "auto":
        merged, planned, one_device_each = _plan_auto(merged)
        if one_device_each:  # the controller keeps an instance's degree: off with degrees (planner/auto.py)
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
        registry=registry, planned=planned, demo_model=demo, pin_instances=bool(merged["pin_instances"]),
        log_dir=merged["log_dir"], log_level=getattr(args, "log_level", "INFO"),
        ready_timeout_s=float(merged["ready_timeout_s"]), drain_timeout_s=float(merged["drain_timeout"]),
        encode_tensor_parallel_size=int(merged["encode_tensor_parallel_size"]),
        prefill_tensor_parallel_size=int(merged["prefill_tensor_parallel_size"]),
        decode_tensor_parallel_size=int(merged["decode_tensor_parallel_size"]),
        mm_store_max_bytes=int(merged["mm_store_max_mb"]) << 20,
        restart=RestartPolicy(first_backoff_s=float(merged["restart_backoff_s"]),
                              max_backoff_s=float(merged["restart_backoff_max_s"]),
                              max_restarts=int(merged["max_restarts"]),
                              stable_after_s=float(merged["restart_stable_s"])),
    )


def _plan_auto(merged: dict) -> tuple[dict, str, bool]:
    """--mode auto: the planner's starting deployment (planner/auto.py) in place of the mode and
    counts, devices counted per rank at the degrees given."""
    from epdserve.planner.auto import DEFAULT_WORKLOAD, plan_start
    from epdserve.planner.deployment import StageDegrees

    lm = merged.get("tensor_parallel_size") or last_flag(_flags(merged["instance_args"]), "--tensor-parallel-size")
    degrees = StageDegrees(int(lm or 1), int(merged.get("encode_tensor_parallel_size") or 1),
                           int(merged.get("prefill_tensor_parallel_size") or 0),
                           int(merged.get("decode_tensor_parallel_size") or 0))
    devices = len(_ids(merged["devices"])) or 2
    plan = plan_start(str(Path(merged["model"]).expanduser()), merged["device"], merged["profile"],
                      merged["expected_workload"] or DEFAULT_WORKLOAD, merged["expected_rate"], devices,
                      slo=slo_of(merged), degrees=degrees)
    line = plan.line() + ("" if degrees.single else "; the role controller is off (it keeps each instance's degree)")
    return ({**merged, "mode": plan.mode, "encode": plan.encode, "prefill": plan.prefill, "decode": plan.decode},
            line, degrees.single)


def ready_line(dep, address: str, http_port: int | None) -> str:
    """``epdserve ready: ...``: where the deployment serves, and where the private MM Store's
    password file is (the password itself never goes to stdout)."""
    spec = dep.spec
    tls = last_flag(spec.scheduler_args, "--tls-cert") is not None
    line = (f"epdserve ready: grpc://{address} mode={spec.mode}{' auto=1' if spec.planned else ''} "
            f"instances={dep.summary()}")
    if dep.kv_hop is not None and dep.kv_hop.hop != "none":  # the P->D hop (deploy/kv_hop.py)
        line += f" kv_hop={dep.kv_hop.hop}"
    line += f" mm_store={dep.mm_store_url}"
    if dep.mm_store_password_file is not None:
        line += f" mm_store_password_file={dep.mm_store_password_file}"
    if dep.cluster_token_file is not None:
        line += f" cluster_token_file={dep.cluster_token_file}"
    if dep.media_key_secret_file is not None:
        line += f" media_key_secret_file={dep.media_key_secret_file}"
    if tls:
        line += " tls=1"
    if http_port:
        line += f" http={'https' if tls else 'http'}://{spec.host}:{http_port}"
    if spec.registry:
        line += f" internal=grpc://{spec.registry}"
    if spec.demo_model:
        line += (f" model={spec.model} (the built-in demo: random weights, its answers are noise; "
                 "serve a real checkpoint with --model DIR)")
    return line


def run(args) -> int:
    from epdserve.deploy.local.deployment import Deployment, LaunchError

    try:
        spec = spec_from_args(args)
        dep = Deployment(spec)
    except (ValueError, OSError) as e:
        log.error("%s", e)
        return 2
    from epdserve.deploy.local.signals import StopSignals

    stop = StopSignals((signal.SIGTERM, signal.SIGINT, signal.SIGHUP), deadline_s=spec.drain_timeout_s + STOP_MARGIN_S,
                       name="launch").install()
    clean = False
    try:
        if spec.planned:
            log.info("auto: %s", spec.planned)
        log.info("starting mode %s (%s); child logs in %s", spec.mode, dep.summary(), dep.log_dir)
        address = dep.start(should_stop=stop.is_set)
        print(ready_line(dep, address, dep.http_port), flush=True)
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
