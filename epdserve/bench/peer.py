"""The peer of the comparison benchmark: `transformers serve --continuous-batching`, in a venv of its own.

Owns `ensure_peer_venv` (create the peer's venv once: `python -m venv`, then pip with pinned
versions), `peer_argv` (the command that starts the peer, from a template with `{venv}`,
`{model}`, `{port}`) and `serving` (start any HTTP server as a child in its own session, wait
until its health URL answers 200, stop it and whatever it started afterwards; its output goes to
a log file that errors quote).

Why a venv of its own: transformers' Qwen2-VL processors need torchvision, and the torchvision
wheels to be had here are CUDA builds that only import beside the torch they were built for
(0.29.1 with torch 2.14.1, whose CUDA libraries come from PyPI: several GB, once), while
epdserve's venv has the CPU build of torch 2.13 and no torchvision. The peer still runs on the
CPU (`--device cpu`). transformers is pinned to this venv's version, so both servers render the
same chat template. Nothing here is global.
"""
from __future__ import annotations

import contextlib
import os
import pathlib
import re
import shlex
import subprocess
import sys
import tempfile
import time
import urllib.request
from importlib import metadata

from epdserve.deploy.local.launcher_process import LauncherProcess

PEER_TORCH = "2.14.1"
PEER_TORCHVISION = "0.29.1"
PEER_CMD = ("{venv}/bin/transformers serve --continuous-batching --device cpu --dtype float32 "
            "--host 127.0.0.1 --port {port} {model}")
_NEVER = re.compile(r"(?!)")  # readiness is the health URL, not a line of output


class PeerError(RuntimeError):
    pass


def default_venv() -> pathlib.Path:
    """`$XDG_CACHE_HOME/epdserve/peer-transformers-serve` (or under ~/.cache)."""
    root = pathlib.Path(os.environ.get("XDG_CACHE_HOME") or pathlib.Path.home() / ".cache")
    return root / "epdserve" / "peer-transformers-serve"


def peer_requirements(transformers_version: str | None = None) -> list[str]:
    """What pip installs into the peer's venv (transformers defaults to this venv's version)."""
    tv = transformers_version or metadata.version("transformers")
    return [f"torch=={PEER_TORCH}", f"torchvision=={PEER_TORCHVISION}", f"transformers[serving]=={tv}"]


def ensure_peer_venv(venv: pathlib.Path, requirements: list[str] | None = None, log=print) -> pathlib.Path:
    """The venv at `venv`, created and filled if it has no `bin/transformers` yet."""
    venv = pathlib.Path(venv)
    if (venv / "bin" / "transformers").exists():
        return venv
    reqs = requirements or peer_requirements()
    log(f"building the peer's venv at {venv} (once): {' '.join(reqs)}; torch's CUDA libraries come from PyPI")
    python = getattr(sys, "_base_executable", None) or sys.executable
    subprocess.run([python, "-m", "venv", str(venv)], check=True)
    subprocess.run([str(venv / "bin" / "python"), "-m", "pip", "install", "-q", *reqs], check=True)
    if not (venv / "bin" / "transformers").exists():
        raise PeerError(f"{venv}: pip finished but there is no bin/transformers")
    return venv


def peer_argv(template: str, *, venv: str | pathlib.Path = "", model: str = "", port: int) -> list[str]:
    """`template` split like a shell would, with {venv}, {model} and {port} filled in each word."""
    return [w.format(venv=venv, model=model, port=port) for w in shlex.split(template)]


@contextlib.contextmanager
def serving(argv: list[str], health_url: str, *, name: str = "peer", ready_timeout_s: float = 900.0,
            env: dict[str, str] | None = None, stop_timeout_s: float = 30.0):
    """Run `argv` until the block ends; the block starts once `health_url` answers 200. Yields the log path."""
    fd, log_path = tempfile.mkstemp(prefix=f"epdserve-{name}-", suffix=".log")
    os.close(fd)
    lp = LauncherProcess(argv, env=env, ready=_NEVER, log_path=log_path, keep_output=False,
                         tie_to_parent=True, name=name)
    try:
        deadline = time.monotonic() + ready_timeout_s
        while not _answers(health_url):
            if lp.proc.poll() is not None:
                raise PeerError(f"{name} exited with {lp.proc.returncode} before {health_url} answered; "
                                f"last output ({log_path}):\n{lp.tail(30)}")
            if time.monotonic() > deadline:
                raise PeerError(f"{name}: {health_url} did not answer within {ready_timeout_s:.0f} s; "
                                f"last output ({log_path}):\n{lp.tail(30)}")
            time.sleep(0.5)
        yield log_path
    finally:
        lp.stop(stop_timeout_s)


def _answers(url: str) -> bool:
    try:
        with urllib.request.urlopen(url, timeout=2) as r:
            return r.status == 200
    except OSError:
        return False
