"""Start one deployment mode with `epdserve launch` for a benchmark, and stop it afterwards.

Owns `launched(...)`: a context manager that runs `epdserve launch --mode M --model DIR --port P`
(P a free local port picked now) as a child process in its own session, drains its output into
a log file, waits for its ready line (`epdserve ready: grpc://HOST:PORT mode=...`; the children's own
"... ready" lines do not count)
and yields a `LaunchedDeployment`; on exit it sends SIGTERM (launch stops its own children) and, if the
process group is still there after a grace period, SIGKILL to that group. If the benchmark
process dies first (even by SIGKILL), the launcher is told (PR_SET_PDEATHSIG) and stops its
children. Nothing here is global.
"""
from __future__ import annotations

import contextlib
import os
import re
import signal
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field

from epdserve.deploy.procs import die_with_parent
from epdserve.net import free_port

READY_RE = re.compile(r"^epdserve ready\b")
ADDRESS_RE = re.compile(r"(?:grpc://)?((?:\d{1,3}\.){3}\d{1,3}|localhost|\[[0-9a-fA-F:]+\]|[\w.-]+):(\d{2,5})\b")


class LaunchError(RuntimeError):
    pass


@dataclass
class LaunchedDeployment:
    mode: str
    address: str
    pid: int
    ready_s: float  # seconds from start to the ready line
    log_path: str
    ready_line: str = ""
    extra: dict = field(default_factory=dict)


def launch_argv(mode: str, model: str, port: int, extra: list[str] | None = None) -> list[str]:
    return [sys.executable, "-m", "epdserve.entrypoints.cli", "launch", "--mode", mode, "--model", str(model),
            "--port", str(port), *(extra or [])]


def parse_ready(line: str, default_address: str) -> str | None:
    """The address a ready line announces (default_address if it names none); None: not a ready line."""
    if not READY_RE.search(line):
        return None
    m = ADDRESS_RE.search(line)
    if not m:
        return default_address
    host = "127.0.0.1" if m.group(1) in ("0.0.0.0", "[::]") else m.group(1)
    return f"{host}:{m.group(2)}"


def _tail(path: str, n: int = 30) -> str:
    try:
        with open(path, errors="replace") as f:
            return "".join(f.readlines()[-n:])
    except OSError:
        return ""


@contextlib.contextmanager
def launched(mode: str, model: str, extra_args: list[str] | None = None, ready_timeout_s: float = 300.0,
             stop_timeout_s: float = 30.0, argv: list[str] | None = None, log_dir: str | None = None,
             port: int | None = None, env: dict[str, str] | None = None):
    """Launch `mode`, yield its `LaunchedDeployment` once ready, stop it (and its children) on exit.

    `argv` replaces the command (tests); it may contain "{port}", filled with the chosen port.
    `env` adds variables to the launcher's environment (its children inherit them).
    """
    port = port or free_port()
    cmd = [a.replace("{port}", str(port)) for a in argv] if argv else launch_argv(mode, model, port, extra_args)
    fd, log_path = tempfile.mkstemp(prefix=f"epdserve-launch-{mode}-", suffix=".log", dir=log_dir)
    os.close(fd)
    t0 = time.monotonic()
    child_env = dict(os.environ, PYTHONUNBUFFERED="1", **(env or {}))
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, bufsize=1,
                            start_new_session=True, env=child_env, preexec_fn=die_with_parent())
    ready = threading.Event()
    found: dict[str, str] = {}

    def drain():
        with open(log_path, "a") as log:
            for line in proc.stdout:
                log.write(line)
                log.flush()
                if not ready.is_set():
                    addr = parse_ready(line, f"127.0.0.1:{port}")
                    if addr:
                        found.update(address=addr, line=line.strip())
                        ready.set()

    reader = threading.Thread(target=drain, name=f"launch-{mode}-log", daemon=True)
    reader.start()
    try:
        while not ready.wait(0.2):
            if proc.poll() is not None:
                reader.join(2)
                if ready.is_set():
                    break
                raise LaunchError(f"launch --mode {mode} exited with {proc.returncode} before it was ready; "
                                  f"last output:\n{_tail(log_path)}")
            if time.monotonic() - t0 > ready_timeout_s:
                raise LaunchError(f"launch --mode {mode} not ready after {ready_timeout_s:.0f} s; "
                                  f"last output:\n{_tail(log_path)}")
        if proc.poll() is not None:
            raise LaunchError(f"launch --mode {mode} exited right after its ready line:\n{_tail(log_path)}")
        yield LaunchedDeployment(mode, found["address"], proc.pid, time.monotonic() - t0, log_path,
                                 found.get("line", ""))
    finally:
        stop(proc, stop_timeout_s)
        reader.join(5)


def stop(proc: subprocess.Popen, timeout_s: float = 30.0) -> None:
    """SIGTERM the launcher, then SIGKILL its process group if anything of it is left."""
    if proc.poll() is None:
        with contextlib.suppress(ProcessLookupError):
            proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout_s)
        except subprocess.TimeoutExpired:
            pass
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(proc.pid, signal.SIGKILL)  # the session we started: whatever of it is still there
    with contextlib.suppress(subprocess.TimeoutExpired):
        proc.wait(5)
