"""`epdserve launch` run as a child process by another program (a benchmark, a test): started in a
session of its own, its output drained by a thread, its ready line found, stopped.

`LauncherProcess(argv)` starts it at once: stdout and stderr together, line by line, into
`output` (and into a log file if given); the first line that matches `ready` (by default the
launcher's own `epdserve ready` line, never a child's "... ready") is kept. `wait_ready` waits for
that line, or for the launcher to exit, or for a timeout. `terminate` sends SIGTERM and waits;
`kill_group` SIGKILLs the session it started (whatever of the deployment is still there); `stop`
does both, in that order. The one implementation behind `bench serve`'s `launched` and the tests'
launch harnesses. Nothing here is global.
"""
from __future__ import annotations

import contextlib
import os
import re
import signal
import subprocess
import sys
import threading
import time

from epdserve.deploy.local.procs import die_with_parent

READY_RE = re.compile(r"^epdserve ready\b")


def launch_argv(*args: str) -> list[str]:
    """This interpreter's `epdserve launch ARGS`."""
    return [sys.executable, "-m", "epdserve.entrypoints.cli", "launch", *args]


class LauncherProcess:
    def __init__(self, argv: list[str], *, env: dict[str, str] | None = None, ready: re.Pattern = READY_RE,
                 log_path: str | None = None, keep_output: bool = True, tie_to_parent: bool = False,
                 name: str = "launch"):
        """Start `argv` (see `launch_argv`). `env`: its whole environment (default: this process's),
        PYTHONUNBUFFERED=1 added. `tie_to_parent`: it gets SIGTERM if this process dies (PDEATHSIG)."""
        self.output: list[str] = []  # every line so far (if keep_output), appended while it runs
        self.ready_match: re.Match | None = None  # the first line matching `ready`
        self._ready_re, self._log_path, self._keep = ready, log_path, keep_output
        self._seen = threading.Event()  # the ready line, or the end of the output
        self._ended = False  # the end of the output
        self.proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, bufsize=1,
                                     start_new_session=True,
                                     env=dict(os.environ if env is None else env, PYTHONUNBUFFERED="1"),
                                     preexec_fn=die_with_parent() if tie_to_parent else None)
        self._reader = threading.Thread(target=self._drain, name=f"{name}-log", daemon=True)
        self._reader.start()

    @property
    def pid(self) -> int:
        return self.proc.pid

    def _drain(self) -> None:
        log = open(self._log_path, "a") if self._log_path else None  # noqa: SIM115 - closed below
        try:
            for line in self.proc.stdout:
                if log:
                    log.write(line)
                    log.flush()
                if self._keep:
                    self.output.append(line)
                if self.ready_match is None:
                    m = self._ready_re.match(line)
                    if m:
                        self.ready_match = m
                        self._seen.set()
        finally:
            if log:
                log.close()
            self._ended = True
            self._seen.set()

    def wait_ready(self, timeout_s: float) -> re.Match | None:
        """The ready line's match once it is printed; None if the launcher exits (or its output
        ends) first, or after `timeout_s`."""
        deadline = time.monotonic() + timeout_s
        while not self._seen.wait(min(0.2, max(0.0, deadline - time.monotonic()))):
            if self.proc.poll() is not None:  # exited; its children may still hold the pipe open
                self._reader.join(2)
                break
            if time.monotonic() >= deadline:
                break
        if self.ready_match is None and self._ended:  # its output ended: it is exiting
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.proc.wait(min(5.0, max(0.0, deadline - time.monotonic())))
        return self.ready_match

    def tail(self, n: int = 40) -> str:
        """The last `n` lines of its output (from the log file when output is not kept)."""
        if self._keep:
            return "".join(self.output[-n:])
        try:
            with open(self._log_path or os.devnull, errors="replace") as f:
                return "".join(f.readlines()[-n:])
        except OSError:
            return ""

    def terminate(self, timeout_s: float) -> int | None:
        """SIGTERM the launcher (it stops its own children) and wait; its exit status, None if still running."""
        if self.proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                self.proc.send_signal(signal.SIGTERM)
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.proc.wait(timeout_s)
        return self.proc.poll()

    def kill_group(self, wait_s: float | None = None) -> None:
        kill_group(self.proc, wait_s)

    def stop(self, timeout_s: float = 30.0) -> None:
        """SIGTERM, then SIGKILL to its session if anything of it is left; the reader is given 5 s to finish."""
        self.terminate(timeout_s)
        self.kill_group(5)
        self._reader.join(5)


def kill_group(proc: subprocess.Popen, wait_s: float | None = None) -> None:
    """SIGKILL the session `proc` leads (started with start_new_session) and wait for `proc` (up to `wait_s`)."""
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(proc.pid, signal.SIGKILL)
    with contextlib.suppress(subprocess.TimeoutExpired):
        proc.wait(wait_s)
