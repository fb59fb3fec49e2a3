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
from epdserve.deploy.signals import SCHEDULER_STOP_DEADLINE_S

log = logging.getLogger(__name__)

STOP_DEADLINE_S = SCHEDULER_STOP_DEADLINE_S  # from the first SIGTERM / SIGINT to the process's exit, at most


def add_parser(subparsers):
    p = add_command(subparsers, "scheduler", run, "run the global gRPC scheduler", __doc__)
    p.add_argument("--model", required=True, help="checkpoint directory (only tokenizer/processor/config are loaded)")
    p.add_argument("--host", default="127.0.0.1", help="interface to bind (default 127.0.0.1; 0.0.0.0 for all)")
    p.add_argument("--port", type=int, default=0, help="port to bind (default 0: a free port, printed when ready)")
    p.add_argument("--instance", action="append", default=[], metavar="HOST:PORT",
                   help="a static instance to adopt (repeatable); instances may also register themselves")
    p.add_argument("--mode", default="", help="deployment mode name reported by GetServerInfo")
    p.add_argument("--max-model-len", type=int, default=None)
    p.add_argument("--probe-interval", type=float, default=1.0, help="seconds between health probes")
    p.add_argument("--probe-timeout", type=float, default=1.0)
    p.add_argument("--heartbeat-interval", type=float, default=1.0, help="heartbeat period told to instances")
    p.add_argument("--unhealthy-after", type=int, default=3, help="failed probes before an instance is dropped")
    p.add_argument("--healthy-after", type=int, default=2, help="good probes before a dropped instance rejoins")
    p.add_argument("--max-requests", type=int, default=1024, help="requests in flight before RESOURCE_EXHAUSTED (default 1024)")
    p.add_argument("--max-requests-per-tenant", type=int, default=None, metavar="N",
                   help="requests one tenant (an API key of --api-keys-file) may have in flight before "
                        "RESOURCE_EXHAUSTED / HTTP 429 with Retry-After (default: only --max-requests)")
    p.add_argument("--max-inflight-per-instance", type=int, default=256,
                   help="requests queued or running on one instance before it counts as full (default 256)")
    p.add_argument("--max-pixels-in-flight", type=int, default=None, metavar="N",
                   help="pixels that the media of the requests in flight declare (images, and every frame of a "
                        "video the decoder holds), counted from admission to each request's first token, before "
                        "RESOURCE_EXHAUSTED; each costs ~14 bytes at the peak of its preprocessing (default 4 x "
                        "--max-request-pixels: 400000000)")
    p.add_argument("--max-attempts", type=int, default=4, help="attempts per request across instance failures")
    p.add_argument("--retry-backoff-s", type=float, default=0.05,
                   help="wait before attempt n+1 of a request: n times this (default 0.05)")
    p.add_argument("--preprocess-threads", type=int, default=4,
                   help="threads tokenising prompts and decoding images (default 4)")
    p.add_argument("--media-index-size", type=int, default=100_000,
                   help="media keys remembered so that clients may resend an image by key (LRU, default 100000)")
    p.add_argument("--stored-keys-size", type=int, default=100_000,
                   help="media keys remembered as already in the MM Store (LRU, default 100000)")
    p.add_argument("--routing", choices=("cache-aware", "least-load"), default="cache-aware",
                   help="where a request prefills: cache-aware (default) = the coupled or P instance with the least "
                        "outstanding work plus prompt tokens it would still have to prefill, counting the prefix this "
                        "scheduler already sent it as cached; least-load = least outstanding work only")
    p.add_argument("--prefix-index-size", type=int, default=131_072, metavar="N",
                   help="cache-aware routing: prompt chunk hashes (16 tokens each) remembered per instance (LRU, "
                        "default 131072)")
    from epdserve.limits import add_limit_args

    add_limit_args(p)
    p.add_argument("--address-file", type=Path, default=None, help="write host:port here once serving")
    c = p.add_argument_group("role controller (`epdserve launch --mode auto` turns it on)")
    c.add_argument("--controller", action="store_true",
                   help="move instances between roles (Instance.SwitchRoles) as queue depths and SLO attainment "
                        "ask, one at a time, with hysteresis; every decision is logged with its reason and exported "
                        "as a metric (scheduler/controller.py). Experimental: 0.55-0.90x goodput with its stage "
                        "moves on a 2-core CPU host, README 'Traffic that shifts, and --mode auto'")
    c.add_argument("--controller-tick-s", type=float, default=5.0, help="seconds between decisions (default 5)")
    c.add_argument("--controller-dwell-s", type=float, default=120.0,
                   help="an instance keeps its roles at least this long (default 120)")
    c.add_argument("--controller-cooldown-s", type=float, default=60.0,
                   help="after a switch, wait this long before the next decision (default 60)")
    c.add_argument("--controller-slo-ttft-ms", type=float, default=3000.0, help="TTFT SLO it counts against (3000)")
    c.add_argument("--controller-slo-tpot-ms", type=float, default=100.0, help="TPOT SLO it counts against (100)")
    c.add_argument("--controller-couple-media-max", type=float, default=1.0,
                   help="media items per request at or under which traffic counts as encode-light: a hot P then "
                        "merges the prefiller and decode into one engine, and encode-heavy traffic splits them "
                        "again (default 1.0; scheduler/coupling.py)")
    c.add_argument("--controller-no-coupling", action="store_true", help="no merge / split moves")
    c.add_argument("--controller-stage-moves", choices=("auto", "on", "off"), default="auto",
                   help="moves that give a hot stage a larger share of an instance (D -> ED, P -> EP, E -> D, ...): "
                        "auto (default) = off while every instance reports the same compute (one CPU host's cores: "
                        "a share moved there adds no compute; measured 0.55-0.90x goodput on a 2-core host), on "
                        "where instances run on devices of their own")
    c.add_argument("--controller-window-s", type=float, default=30.0,
                   help="sliding window of load samples and finished requests the pressures are judged over "
                        "(default 30; shorter reacts faster to a change of traffic, and to noise)")
    from epdserve.entrypoints.fronts import add_front_flags, add_security_flags

    add_front_flags(p)
    add_security_flags(p)
    return p


def config_from_args(args):
    from epdserve.limits import limits_from_args
    from epdserve.scheduler import SchedulerConfig

    return SchedulerConfig(
        model=args.model, host=args.host, port=args.port, static_instances=args.instance, mode=args.mode,
        max_model_len=args.max_model_len, probe_interval_s=args.probe_interval, probe_timeout_s=args.probe_timeout,
        heartbeat_interval_s=args.heartbeat_interval, unhealthy_after=args.unhealthy_after,
        healthy_after=args.healthy_after, max_requests_in_flight=args.max_requests,
        max_requests_per_tenant=getattr(args, "max_requests_per_tenant", None),
        max_pixels_in_flight=args.max_pixels_in_flight,
        max_inflight_per_instance=args.max_inflight_per_instance, max_attempts=args.max_attempts,
        retry_backoff_s=args.retry_backoff_s, preprocess_threads=args.preprocess_threads,
        media_index_size=args.media_index_size, stored_keys_size=args.stored_keys_size, limits=limits_from_args(args),
        controller=_controller_config(args), routing=args.routing, prefix_index_size=args.prefix_index_size,
    )


def _controller_config(args):
    """`--controller`: the role controller's ControllerConfig from its flags; else None."""
    if not getattr(args, "controller", False):
        return None
    from epdserve.scheduler.controller import ControllerConfig
    from epdserve.scheduler.pressure import PressureConfig

    return ControllerConfig(tick_s=args.controller_tick_s, min_dwell_s=args.controller_dwell_s,
                            cooldown_s=args.controller_cooldown_s, ttft_slo_s=args.controller_slo_ttft_ms / 1e3,
                            tpot_slo_s=args.controller_slo_tpot_ms / 1e3,
                            couple_media_max=args.controller_couple_media_max,
                            coupling=not args.controller_no_coupling, stage_moves=args.controller_stage_moves,
                            pressure=PressureConfig(window_s=args.controller_window_s))


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
    from epdserve.deploy.signals import StopSignals, parent_pid_from_env

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
