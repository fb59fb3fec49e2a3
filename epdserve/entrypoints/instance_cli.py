"""`epdserve instance`: run one instance process until signalled: its stage workers (E, P, D,
co-located EP / ED, or one coupled PD / EPD engine), registered with a scheduler.

Prints one line when it serves: ``epdserve instance ready: <id> roles=<roles> grpc://<host>:<port>
dtype=<dtype> (<why: given, or what auto saw>) lm-weights=<how the LM's attention and MLP weights are
held; a quantized MoE model's experts' method in parentheses, e.g. int8(experts:int8)> decode-graphs=<on (keys, capture seconds) | off (why)>`` (e.g. ``dtype=bfloat16 (auto: this CPU
has AVX512-BF16) lm-weights=int8 decode-graphs=off (the platform has no graphs ...)``).
SIGTERM / SIGINT stop it (deregister, stop taking calls, let calls in flight finish for up to
--drain-timeout seconds, stop the workers). The process exits within --drain-timeout +
INSTANCE_STOP_MARGIN_S seconds of the first signal, always: if stopping hangs, it exits with code 1. A
signal during start-up stops it the same way. Started by `epdserve launch`, it also stops when
the launcher dies (PR_SET_PDEATHSIG, and a watch on its parent's pid).
An instance that must be restarted (KV blocks held by a stuck receive with no bound:
`InstanceHost.check_restart`) turns NOT_SERVING, stops the same way and exits with code 75
(RESTART_EXIT_CODE); `epdserve launch` restarts an instance that exits, as does Kubernetes.
"""
from __future__ import annotations

import logging
import os
import sys

from epdserve.commands import add_command
from epdserve.deploy.local.signals import INSTANCE_STOP_MARGIN_S

log = logging.getLogger(__name__)


def add_parser(subparsers):
    from epdserve.instance.config import add_instance_args

    p = add_command(subparsers, "instance", run, "run one E/P/D instance process", __doc__)
    add_instance_args(p)
    from epdserve.security.options import add_instance_security_flags

    add_instance_security_flags(p)
    p.add_argument("--drain-timeout", type=float, default=10.0,
                   help="on SIGTERM/SIGINT, let calls in flight finish for up to this many seconds (default 10); "
                        f"the process exits within this + {INSTANCE_STOP_MARGIN_S:.0f} s, always")
    return p


def run(args) -> int:
    from epdserve.deploy.local.signals import StopSignals, parent_pid_from_env
    from epdserve.instance.config import from_args
    from epdserve.instance.host import InstanceHost

    if args.drain_timeout < 0:
        log.error("--drain-timeout must be >= 0")
        return 2
    try:
        config = from_args(args)
    except ValueError as e:
        log.error("%s", e)
        return 2
    stop = StopSignals(deadline_s=args.drain_timeout + INSTANCE_STOP_MARGIN_S, parent_pid=parent_pid_from_env(),
                       name="instance").install()
    from epdserve.security.options import InstanceSecurity

    try:
        security = InstanceSecurity.from_args(args)
        security.check_exposure(config.bind_host or config.host)  # before the model loads: refused at once
    except (ValueError, OSError) as e:
        log.error("%s", e)
        return 2
    host = InstanceHost(config, security)
    rc = 0
    try:
        host.start()
        if not stop.is_set():
            print(f"epdserve instance ready: {host.instance_id} roles={host.roles} "
                  f"grpc://{host.config.host}:{host.port} dtype={host.dtype_line()} lm-weights={host.weights_method()} "
                  f"decode-graphs={host.graphs_line()}", flush=True)
        rc = serve_until_stopped(host, stop)
    except Exception as e:
        log.error("instance failed: %s", e)
        rc = 1
    finally:
        host.stop(grace_s=args.drain_timeout)
    # Everything is closed; skip interpreter teardown, whose garbage collection of torch /
    # transformers / gRPC objects takes seconds on a loaded CPU and delays the launcher's stop.
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(rc)


def serve_until_stopped(host, stop, check_s: float | None = None) -> int:
    """Wait for a stop signal (0), or for the instance to ask for a restart (RESTART_EXIT_CODE),
    looking every `check_s` seconds (RESTART_CHECK_S)."""
    from epdserve.deploy.local.supervisor import RESTART_EXIT_CODE
    from epdserve.instance.host import RESTART_CHECK_S

    while not stop.wait(RESTART_CHECK_S if check_s is None else check_s):
        why = host.check_restart()
        if why is not None:
            log.error("stopping for a restart (exit code %d): %s", RESTART_EXIT_CODE, why)
            return RESTART_EXIT_CODE
    return 0


if __name__ == "__main__":
    from epdserve.entrypoints.cli import main

    sys.exit(main(["instance", *sys.argv[1:]]))
