"""`epdserve launch` as a real process group for a test: started, its ready line parsed, stopped
with SIGTERM (which must exit 0), and killed if anything went wrong — with no secret in its output."""
from __future__ import annotations

import contextlib
import os
import re
import signal
import subprocess
import sys
import threading


@contextlib.contextmanager
def launched(args: list[str], env: dict[str, str], ready: re.Pattern, secrets: tuple[str, ...] = ()):
    """Yield (the ready line's named groups plus ``launcher_pid``, the output lines so far) of
    `epdserve launch ARGS`."""
    argv = [sys.executable, "-m", "epdserve.entrypoints.cli", "launch", *args]
    proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True,
                            env=dict(env, PYTHONUNBUFFERED="1"))
    output: list[str] = []
    found: dict[str, str] = {}
    seen = threading.Event()

    def drain():
        for line in proc.stdout:
            output.append(line)
            m = ready.match(line)
            if m:
                found.update(m.groupdict())
                seen.set()
        seen.set()

    threading.Thread(target=drain, daemon=True).start()
    try:
        if not seen.wait(600) or not found:
            raise AssertionError("launch never printed its ready line:\n" + "".join(output[-40:]))
        found["launcher_pid"] = str(proc.pid)  # the root of the deployment's process tree
        yield found, output
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(120) == 0, "".join(output[-40:])
        assert not any(s in "".join(output) for s in secrets)  # never logged
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
