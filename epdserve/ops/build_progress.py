"""What a user waiting on the first native-operator build sees: one line on stderr —
"building native operators (first run only, ~1 min); log at <path>" — then a dot every few
seconds while the compiler runs, and how it ended. Nothing when the build is cached.

`BuildProgress(log_path, stream)` is a context manager around the build; the build's outcome
(its time, or the compiler output of a failure) goes to `log_path`.
"""
from __future__ import annotations

import sys
import threading
import time
from pathlib import Path


class BuildProgress:
    def __init__(self, log_path: Path, stream=None, dot_every_s: float = 3.0):
        self.log_path = Path(log_path)
        self.stream = stream if stream is not None else sys.stderr
        self.dot_every_s = dot_every_s
        self._done = threading.Event()
        self._thread: threading.Thread | None = None
        self._t0 = 0.0

    def _write(self, text: str) -> None:
        try:
            self.stream.write(text)
            self.stream.flush()
        except (ValueError, OSError):  # a closed stream must not fail the build
            pass

    def _dots(self) -> None:
        while not self._done.wait(self.dot_every_s):
            self._write(".")

    def __enter__(self) -> BuildProgress:
        self._t0 = time.monotonic()
        self._write(f"building native operators (first run only, ~1 min); log at {self.log_path} ")
        self._thread = threading.Thread(target=self._dots, name="ops-build-progress", daemon=True)
        self._thread.start()
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        self._done.set()
        if self._thread is not None:
            self._thread.join()
        took = time.monotonic() - self._t0
        if exc is None:
            self._write(f" done in {took:.0f} s\n")
            self._log(f"built in {took:.1f} s\n")
        else:
            self._write(f" failed after {took:.0f} s (see the log)\n")
            self._log(f"failed after {took:.1f} s: {type(exc).__name__}:\n{exc}\n")

    def _log(self, text: str) -> None:
        try:
            self.log_path.parent.mkdir(parents=True, exist_ok=True)
            self.log_path.write_text(text)
        except OSError:
            pass
