"""`epdserve instance`: run one instance process until signalled: its stage workers (E, P, D,
co-located EP / ED, or one coupled PD / EPD engine), registered with a scheduler.

Prints one line when it serves: ``epdserve instance ready: <id> roles=<roles> grpc://<host>:<port>``.
SIGTERM / SIGINT stop it cleanly (deregister, stop the server, stop the workers).
"""
from __future__ import annotations

import logging
import os
import signal
import sys
import threading

from epdserve.entrypoints.cli import add_command

log = logging.getLogger(__name__)


def add_parser(subparsers):
    from epdserve.instance.config import add_instance_args

    p = add_command(subparsers, "instance", run, "run one E/P/D instance process", __doc__)
    add_instance_args(p)
    return p


def run(args) -> int:
    from epdserve.instance.config import from_args
    from epdserve.instance.host import InstanceHost

    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())
    try:
        config = from_args(args)
    except ValueError as e:
        log.error("%s", e)
        return 2
    host = InstanceHost(config)
    rc = 0
    try:
        host.start()
        if not stop.is_set():
            print(f"epdserve instance ready: {host.instance_id} roles={host.roles} "
                  f"grpc://{host.config.host}:{host.port}", flush=True)
        while not stop.wait(1.0):
            pass
    except Exception as e:
        log.error("instance failed: %s", e)
        rc = 1
    finally:
        host.stop()
    # Everything is closed; skip interpreter teardown, whose garbage collection of torch /
    # transformers / gRPC objects takes seconds on a loaded CPU and delays the launcher's stop.
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(rc)


if __name__ == "__main__":
    from epdserve.entrypoints.cli import main

    sys.exit(main(["instance", *sys.argv[1:]]))
