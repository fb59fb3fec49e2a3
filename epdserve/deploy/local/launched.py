"""Start one deployment mode with `epdserve launch` for a benchmark or a check, and stop it afterwards.

Owns `launched(...)`: a context manager that runs `epdserve launch --mode M --model DIR --port P`
(P a free local port picked now) as a child process in its own session, drains its output into
a log file, waits for its ready line (`epdserve ready: grpc://HOST:PORT mode=...`; the children's own
"... ready" lines do not count)
and yields a `LaunchedDeployment`; on exit it sends SIGTERM (launch stops its own children) and, if the
process group is still there after a grace period, SIGKILL to that group. If the benchmark
process dies first (even by SIGKILL), the launcher is told (PR_SET_PDEATHSIG) and stops its
children. Starting, reading and stopping the process is `epdserve.deploy.local.launcher_process`'s.
`variant_args` / `variant_mode` read the `MODE#NAME` variants benchmarks launch (`--mode-arg`).
Nothing here is global.
"""
from __future__ import annotations

import contextlib
import os
import re
import shlex
import tempfile
import time
from dataclasses import dataclass, field

from epdserve.deploy.local.launcher_process import READY_RE, LauncherProcess
from epdserve.deploy.local.launcher_process import launch_argv as process_launch_argv
from epdserve.net import free_port

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
    return process_launch_argv("--mode", mode, "--model", str(model), "--port", str(port), *(extra or []))


def parse_ready(line: str, default_address: str) -> str | None:
    """The address a ready line announces (default_address if it names none); None: not a ready line."""
    if not READY_RE.search(line):
        return None
    m = ADDRESS_RE.search(line)
    if not m:
        return default_address
    host = "127.0.0.1" if m.group(1) in ("0.0.0.0", "[::]") else m.group(1)
    return f"{host}:{m.group(2)}"


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
    lp = LauncherProcess(cmd, env=dict(os.environ, **(env or {})), log_path=log_path, keep_output=False,
                         tie_to_parent=True, name=f"launch-{mode}")
    try:
        m = lp.wait_ready(ready_timeout_s)
        if m is None:
            if lp.proc.poll() is not None:
                raise LaunchError(f"launch --mode {mode} exited with {lp.proc.returncode} before it was ready; "
                                  f"last output:\n{lp.tail(30)}")
            raise LaunchError(f"launch --mode {mode} not ready after {ready_timeout_s:.0f} s; "
                              f"last output:\n{lp.tail(30)}")
        if lp.proc.poll() is not None:
            raise LaunchError(f"launch --mode {mode} exited right after its ready line:\n{lp.tail(30)}")
        yield LaunchedDeployment(mode, parse_ready(m.string, f"127.0.0.1:{port}"), lp.pid, time.monotonic() - t0,
                                 log_path, m.string.strip())
    finally:
        lp.stop(stop_timeout_s)


def variant_args(items: list[str]) -> dict[str, list[str]]:
    """`--mode-arg MODE#NAME=ARGS` items → {MODE#NAME: launch arguments} (repeated items add up)."""
    out: dict[str, list[str]] = {}
    for item in items:
        mode, _, extra = item.partition("=")
        out.setdefault(mode.strip(), []).extend(shlex.split(extra))
    return out


def variant_mode(target: str) -> str:
    """The mode a target names: MODE#NAME is a variant of MODE, launched with its own arguments."""
    return target.partition("#")[0]

