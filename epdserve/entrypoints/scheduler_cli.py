"""`epdserve scheduler`: run the global scheduler until signalled: the public EPDServe service, the
instance Registry with health checks, and the routing of each request across E, P and D instances.

Prints ``epdserve scheduler internal: grpc://<host>:<port>`` (the instance Registry's own port,
loopback unless --internal-host names the cluster network) and then, when it serves,
``epdserve scheduler ready: <id> grpc://<host>:<port>`` (and writes them to
--internal-address-file / --address-file when given, for launchers that pass port 0).
Instances register themselves at the internal port (`epdserve instance --scheduler
HOST:INTERNAL_PORT`) or are listed with --instance. A port beyond loopback that would serve
unauthenticated callers is refused at start (see --insecure). SIGHUP re-reads --api-keys-file.
SIGTERM / SIGINT stop it: it stops taking requests, aborts those in flight and
exits within STOP_DEADLINE_S seconds, always. Started by `epdserve launch`, it also stops when
the launcher dies.
"""
from __future__ import annotations

import asyncio
import logging
import sys
from pathlib import Path

from epdserve.commands import add_command
from epdserve.deploy.local.signals import SCHEDULER_STOP_DEADLINE_S
from epdserve.settings import add_flags, from_flags

log = logging.getLogger(__name__)

STOP_DEADLINE_S = SCHEDULER_STOP_DEADLINE_S  # from the first SIGTERM / SIGINT to the process's exit, at most


def add_parser(subparsers):
    from epdserve.limits import add_limit_args
    from epdserve.scheduler.config import SchedulerConfig
    from epdserve.scheduler.controller import ControllerConfig
    from epdserve.scheduler.pressure import PressureConfig

    p = add_command(subparsers, "scheduler", run, "run the global gRPC scheduler", __doc__)
    add_flags(p, SchedulerConfig)  # every flag from its field (scheduler/config.py)
    add_limit_args(p)
    p.add_argument("--address-file", type=Path, default=None, help="write host:port here once serving")
    c = p.add_argument_group("role controller (`epdserve launch --mode auto` turns it on)")
    c.add_argument("--controller", action="store_true",
                   help="move instances between roles (Instance.SwitchRoles) as queue depths and SLO attainment "
                        "ask, one at a time, with hysteresis; every decision is logged with its reason and exported "
                        "as a metric (scheduler/controller.py). Experimental: 0.55-0.90x goodput with its stage "
                        "moves on a 2-core CPU host, README 'Traffic that shifts, and --mode auto'")
    add_flags(c, ControllerConfig)  # --controller-* and the SLO pair (epdserve/slo.py)
    add_flags(c, PressureConfig)
    from epdserve.entrypoints.fronts import add_front_flags, add_security_flags

    add_front_flags(p)
    add_security_flags(p)
    return p


def config_from_args(args):
    from epdserve.limits import limits_from_args
    from epdserve.scheduler.config import SchedulerConfig

    return from_flags(SchedulerConfig, args, limits=limits_from_args(args), controller=_controller_config(args))


def _controller_config(args):
    """`--controller`: the role controller's ControllerConfig from its flags; else None."""
    if not getattr(args, "controller", False):
        return None
    from epdserve.scheduler.controller import ControllerConfig
    from epdserve.scheduler.pressure import PressureConfig

    return from_flags(ControllerConfig, args, pressure=from_flags(PressureConfig, args))


async def serve(config, address_file: Path | None = None, signals=None, fronts=None,
                internal_file: Path | None = None) -> None:
    """Serve until `signals` (a `deploy.signals.StopSignals`; None: forever) asks to stop;
    `address_file` / `internal_file`: where to write the public / internal host:port."""
    from epdserve.entrypoints.fronts import write_atomic
    from epdserve.scheduler import SchedulerServer

    controller_metrics = None
    if fronts is not None and config.controller is not None:
        from epdserve.metrics.controller import ControllerMetrics

        controller_metrics = ControllerMetrics(fronts.metrics.registry)
    server = SchedulerServer(config, observer=fronts.metrics if fronts is not None else None,
                             security=fronts.security if fronts is not None else None,
                             controller_observer=controller_metrics)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    if signals is not None:
        signals.on_stop(lambda: loop.call_soon_threadsafe(stop.set))
    await server.start()
    _reload_keys_on_sighup(server.security, loop)
    try:
        if fronts is not None:  # the HTTP front, on this loop (entrypoints.fronts)
            await fronts.start(server)
        write_atomic(internal_file, server.internal_address)
        write_atomic(address_file, server.address)
        print(f"epdserve scheduler internal: grpc://{server.internal_address}", flush=True)
        print(f"epdserve scheduler ready: {server.scheduler_id} grpc://{server.address}", flush=True)
        await stop.wait()
    finally:
        if fronts is not None:
            await fronts.stop()
        await server.stop()


def _reload_keys_on_sighup(security, loop) -> None:
    """SIGHUP: re-read the keys file (on the loop, which owns the keys' users); nothing without one.
    signal.signal, not loop.add_signal_handler: that would take StopSignals' wakeup fd."""
    import signal
    import threading

    keys = getattr(security, "tenants", None)
    if keys is None or keys.file is None or threading.current_thread() is not threading.main_thread():
        return
    signal.signal(signal.SIGHUP, lambda *_: loop.call_soon_threadsafe(keys.reload))


def run(args) -> int:
    try:
        config = config_from_args(args)
        from epdserve.entrypoints.fronts import Fronts

        fronts = Fronts.from_args(args)
    except (ValueError, OSError) as e:
        log.error("%s", e)
        return 2
    from epdserve.deploy.local.signals import StopSignals, parent_pid_from_env

    signals = StopSignals(deadline_s=STOP_DEADLINE_S, parent_pid=parent_pid_from_env(), name="scheduler").install()
    try:
        asyncio.run(serve(config, args.address_file, signals, fronts, getattr(args, "internal_address_file", None)))
        return 0
    except Exception as e:
        log.error("scheduler failed: %s", e)
        return 1
    finally:
        signals.stopped()


def main(argv: list[str] | None = None) -> int:
    """Standalone entry (``python -m epdserve.entrypoints.scheduler_cli ...``), same flags."""
    import argparse

    parser = argparse.ArgumentParser(prog="epdserve")
    parser.add_argument("--log-level", default="INFO")
    add_parser(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(["scheduler", *(sys.argv[1:] if argv is None else argv)])
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
