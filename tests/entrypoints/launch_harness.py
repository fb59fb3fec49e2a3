"""`epdserve launch` as a real process group for a test: started, its ready line parsed, stopped
with SIGTERM (which must exit 0), and killed if anything went wrong — with no secret in its output.
The process itself is `epdserve.deploy.local.launcher_process.LauncherProcess`."""
from __future__ import annotations

import contextlib
import re

from epdserve.deploy.local.launcher_process import LauncherProcess, launch_argv


@contextlib.contextmanager
def launched(args: list[str], env: dict[str, str], ready: re.Pattern, secrets: tuple[str, ...] = ()):
    """Yield (the ready line's named groups plus ``launcher_pid``, the output lines so far) of
    `epdserve launch ARGS`."""
    lp = LauncherProcess(launch_argv(*args), env=env, ready=ready)
    try:
        m = lp.wait_ready(600)
        if m is None or not m.groupdict():
            raise AssertionError("launch never printed its ready line:\n" + lp.tail(40))
        found = m.groupdict()
        found["launcher_pid"] = str(lp.pid)  # the root of the deployment's process tree
        yield found, lp.output
        assert lp.terminate(120) == 0, lp.tail(40)
        assert not any(s in "".join(lp.output) for s in secrets)  # never logged
    finally:
        if lp.proc.poll() is None:
            lp.kill_group()
