"""`StopSignals`: how every epdserve process learns it must stop, without a lock in a signal handler.

The Python-level handler does nothing; the interpreter's C-level handler writes the signal
number to a non-blocking pipe (`signal.set_wakeup_fd`) the moment the signal arrives, whatever
the main thread is doing (inside a lock, a C call, a model load). A daemon thread reads that
pipe and does the work a handler must not: it sets `requested` (a `threading.Event` the main
loop waits on), calls the `on_stop` callbacks (e.g. to wake an event loop: they run in that
thread) and arms the stop deadline: if the process still exists `deadline_s` after the first
signal, the same thread ends it with `os._exit(exit_code)` — so a stop is bounded even when the
code that stops it (or the interpreter's teardown after it) hangs. Repeated signals are counted and
change nothing else (they cannot deadlock; the first one's deadline stands).

When `parent_pid` is given (a launcher sets EPDSERVE_PARENT_PID for its children), the thread
also watches it: once this process's parent is no longer that pid (the launcher died, even by
SIGKILL, and the child was re-parented), it stops as if signalled. This backs up
PR_SET_PDEATHSIG, which misses a parent that died before the child set it.

Install from the main thread (Python's rule for signal handlers and the wakeup fd).
"""
from __future__ import annotations

import logging
import os
import select
import signal
import threading
import time

log = logging.getLogger(__name__)

PARENT_PID_ENV = "EPDSERVE_PARENT_PID"
INSTANCE_STOP_MARGIN_S = 5.0  # an instance exits within its --drain-timeout + this (workers, store)
SCHEDULER_STOP_DEADLINE_S = 10.0  # a scheduler exits within this of its first SIGTERM / SIGINT
_PARENT_POLL_S = 0.5


def _ignore(signum, frame) -> None:  # the C handler already wrote to the wakeup fd
    pass


def parent_pid_from_env() -> int | None:
    v = os.environ.get(PARENT_PID_ENV, "")
    return int(v) if v.isdigit() else None


class StopSignals:
    def __init__(self, signals=(signal.SIGTERM, signal.SIGINT), *, deadline_s: float, exit_code: int = 1,
                 parent_pid: int | None = None, name: str = "process"):
        if deadline_s <= 0:
            raise ValueError("deadline_s must be > 0")
        self.signals = tuple(signals)
        self.deadline_s = deadline_s
        self.exit_code = exit_code
        self.parent_pid = parent_pid
        self.name = name
        self.requested = threading.Event()  # set (by the watcher thread) when a stop was asked for
        self.received: list[int] = []  # signal numbers, in order of arrival (0: the parent died)
        self._r, self._w = os.pipe()
        os.set_blocking(self._w, False)
        self._callbacks: list = []
        self._thread = threading.Thread(target=self._watch, name="stop-signals", daemon=True)

    def install(self) -> "StopSignals":
        for sig in self.signals:
            signal.signal(sig, _ignore)
        signal.set_wakeup_fd(self._w, warn_on_full_buffer=False)
        self._thread.start()
        return self

    def on_stop(self, fn) -> None:
        """Call `fn()` (in the watcher thread) when a stop is requested; at once if it was."""
        self._callbacks.append(fn)
        if self.requested.is_set():
            fn()

    def wait(self, timeout_s: float | None = None) -> bool:
        """Block until a stop is requested (True) or `timeout_s` passes (False)."""
        return self.requested.wait(timeout_s)

    def is_set(self) -> bool:
        return self.requested.is_set()

    def stopped(self) -> None:
        """The process has stopped its work (main thread): further signals are ignored, so a late
        one cannot kill it with SIG_DFL while the interpreter tears down. The deadline stays armed."""
        for sig in self.signals:
            signal.signal(sig, signal.SIG_IGN)

    # ---------------------------------------------------------------- the watcher thread
    def _watch(self) -> None:
        while not self._read(_PARENT_POLL_S):
            if self.parent_pid is not None and os.getppid() != self.parent_pid:
                self.received.append(0)
                log.warning("%s: parent %d is gone; stopping", self.name, self.parent_pid)
                break
        first = self.received[0] if self.received else 0
        if first:
            log.info("%s: %s received; stopping within %.0f s", self.name, signal.Signals(first).name, self.deadline_s)
        self.requested.set()
        for fn in list(self._callbacks):
            try:
                fn()
            except Exception:  # a callback's failure must not disarm the deadline
                log.exception("%s: stop callback failed", self.name)
        deadline = time.monotonic() + self.deadline_s
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                log.error("%s did not stop within %.0f s of the stop request; exiting now", self.name, self.deadline_s)
                for h in logging.getLogger().handlers:
                    try:
                        h.flush()
                    except Exception:  # a closed stream: nothing more to save
                        pass
                os._exit(self.exit_code)
            self._read(min(left, _PARENT_POLL_S))  # keep draining the pipe; later signals change nothing

    def _read(self, timeout_s: float) -> bool:
        """Wait up to `timeout_s` for signal numbers on the pipe; True if any came."""
        ready, _, _ = select.select([self._r], [], [], timeout_s)
        if not ready:
            return False
        data = os.read(self._r, 64)
        self.received.extend(b for b in data if b)
        return bool(data)
