"""Child processes of `epdserve launch`: started so that none can outlive the launcher.

Each child runs `python -m <module> <args>` (default module: the `epdserve` CLI):
- in its own process group (Ctrl-C in a terminal reaches only the launcher, which then stops
  the children in order; stopping a child signals its whole group, grandchildren included);
- with PR_SET_PDEATHSIG=SIGTERM on Linux, so it is told to stop if the launcher dies without
  cleaning up (even SIGKILL). Linux sends it when the *thread* that spawned the child exits:
  spawn children from the launcher's main thread. A launcher that died before the child set it
  is caught right after (the child's parent pid is no longer the launcher's), and the child's
  environment names the launcher (EPDSERVE_PARENT_PID) so that epdserve children also watch it
  (`deploy.signals.StopSignals`).
- its stdout/stderr go to `log_stream` (default: the launcher's stderr, each line prefixed
  with the child's name).
"""
from __future__ import annotations

import logging
import os
import signal
import subprocess
import sys
import threading
import time

log = logging.getLogger(__name__)


def die_with_parent():
    """A preexec_fn: the child gets SIGTERM when this process (its parent) dies; None off Linux.

    Everything is looked up before the fork, so the child runs no import and takes no lock that
    another thread of the parent may have held at fork time; only prctl, getppid and _exit run
    there."""
    if not sys.platform.startswith("linux"):
        return None
    import ctypes

    prctl = ctypes.CDLL(None, use_errno=True).prctl
    parent, sigterm = os.getpid(), int(signal.SIGTERM)

    def child() -> None:  # between fork and exec
        prctl(1, sigterm)  # PR_SET_PDEATHSIG
        if os.getppid() != parent:  # the parent died before prctl: nobody will send the signal
            os._exit(1)

    return child


class ChildProcess:
    def __init__(self, name: str, argv: list[str], env: dict[str, str] | None = None, log_stream=None,
                 prefix: str | None = None, module: str = "epdserve.entrypoints.cli"):
        self.name = name
        self.prefix = f"[{name}] " if prefix is None else prefix
        self.argv = [sys.executable, "-m", module, *argv]
        self.env = env
        self.log_stream = log_stream if log_stream is not None else sys.stderr
        self.proc: subprocess.Popen | None = None
        self._pump: threading.Thread | None = None
        self._stopped = False  # stop() ran: the group was killed and the child reaped (its pid may be reused)

    @property
    def pid(self) -> int | None:
        return self.proc.pid if self.proc else None

    def start(self) -> "ChildProcess":
        env = dict(os.environ)
        env.update(self.env or {})
        env.setdefault("PYTHONUNBUFFERED", "1")
        from epdserve.deploy.local.signals import PARENT_PID_ENV

        env[PARENT_PID_ENV] = str(os.getpid())
        self.proc = subprocess.Popen(
            self.argv,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            env=env,
            start_new_session=True,
            preexec_fn=die_with_parent(),
        )
        self._pump = threading.Thread(target=self._forward, name=f"log[{self.name}]", daemon=True)
        self._pump.start()
        return self

    def _forward(self) -> None:
        for raw in self.proc.stdout:
            try:
                self.log_stream.write(self.prefix + raw.decode(errors="replace"))
                self.log_stream.flush()
            except (ValueError, OSError):  # the stream was closed at exit
                pass

    def poll(self) -> int | None:
        return self.proc.poll() if self.proc else None

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def signal(self, sig: int) -> None:
        if self.proc is None:
            return
        try:
            os.killpg(self.proc.pid, sig)
        except (ProcessLookupError, PermissionError):
            pass

    def wait(self, timeout_s: float) -> bool:
        if self.proc is None:
            return True
        try:
            self.proc.wait(timeout_s)
            return True
        except subprocess.TimeoutExpired:
            return False

    def stop(self, timeout_s: float = 10.0) -> int | None:
        """SIGTERM the child's group, then SIGKILL it after `timeout_s`. Returns the exit code.
        Once only: a second call signals nothing (the pid, reaped, may belong to another process now)."""
        if self.proc is None or self._stopped:
            return None if self.proc is None else self.proc.returncode
        self._stopped = True
        if self.alive():
            self.signal(signal.SIGTERM)
            if not self.wait(timeout_s):
                log.warning("%s did not stop within %.0f s; killing it", self.name, timeout_s)
        self.signal(signal.SIGKILL)  # the group: also anything the child left behind
        self.proc.wait()
        if self._pump is not None:
            self._pump.join(2.0)
        if self.proc.stdout:
            self.proc.stdout.close()
        return self.proc.returncode


def stop_all(children: list[ChildProcess], timeout_s: float = 10.0) -> None:
    """SIGTERM every child at once (they stop in parallel), then reap each, SIGKILL past the deadline."""
    for c in children:
        if c.alive():
            c.signal(signal.SIGTERM)
    deadline = time.monotonic() + timeout_s
    for c in children:
        c.stop(max(0.1, deadline - time.monotonic()))
