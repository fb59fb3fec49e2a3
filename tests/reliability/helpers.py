"""Launched deployments for the reliability tests: start `epdserve launch` as a real process
(`epdserve.deploy.local.launcher_process.LauncherProcess`), read its ready line, find its children, and
check that nothing of it is left."""
from __future__ import annotations

import os
import re
import socket
import time

import psutil

from epdserve.deploy.local.launcher_process import LauncherProcess, kill_group, launch_argv

__all__ = ["Launched", "alive", "family", "kill_group", "launch", "listening", "signal_storm", "wait_exit"]

READY = re.compile(r"^epdserve ready: grpc://(\S+) mode=\S+ .* mm_store=redis://([\d.]+:\d+)")


class Launched(LauncherProcess):
    """The launcher (`proc`, `output`, `tail()`), and once ready its gRPC `address` and `mm_store`."""

    @property
    def address(self) -> str:
        return self.ready_match.group(1) if self.ready_match else ""

    @property
    def mm_store(self) -> str:
        return self.ready_match.group(2) if self.ready_match else ""

    def children(self) -> dict[str, psutil.Process]:
        """The launcher's live children by kind: "scheduler", "mm_store", "instance:<roles>#<k>"."""
        out, k = {}, 0
        for p in psutil.Process(self.proc.pid).children():
            try:  # one child may exit (or be restarted) while this reads the others
                cmd = " ".join(p.cmdline())
                if p.status() == psutil.STATUS_ZOMBIE:
                    continue
            except psutil.NoSuchProcess:
                continue
            if "scheduler_cli" in cmd:
                out["scheduler"] = p
            elif "valkey" in cmd or "redis-server" in cmd:
                out["mm_store"] = p
            elif " instance " in cmd:
                roles = cmd.split("--roles ")[1].split()[0]
                out[f"instance:{roles}#{k}"] = p
                k += 1
        return out


def launch(model, *args: str, wait_ready: bool = True, timeout_s: float = 300) -> Launched:
    dep = Launched(launch_argv("--model", str(model), "--kv-cache-mb", "16", *args), ready=READY)
    if wait_ready and not dep.wait_ready(timeout_s):
        kill_group(dep.proc)
        raise AssertionError(f"launch never got ready:\n{dep.tail()}")
    return dep


def family(pid: int) -> list[psutil.Process]:
    root = psutil.Process(pid)
    return [root, *root.children(recursive=True)]


def alive(procs: list[psutil.Process]) -> list[psutil.Process]:
    out = []
    for p in procs:
        try:
            if p.is_running() and p.status() != psutil.STATUS_ZOMBIE:
                out.append(p)
        except psutil.NoSuchProcess:
            pass
    return out


def listening(address: str) -> bool:
    host, port = address.rsplit(":", 1)
    with socket.socket() as s:
        s.settimeout(0.5)
        return s.connect_ex((host, int(port))) == 0


def wait_exit(procs: list[psutil.Process], timeout_s: float) -> float:
    """Seconds until every process in `procs` is gone; AssertionError past `timeout_s`."""
    t0 = time.monotonic()
    while alive(procs):
        if time.monotonic() - t0 > timeout_s:
            raise AssertionError(f"still running after {timeout_s} s: {[p.cmdline()[:6] for p in alive(procs)]}")
        time.sleep(0.05)  # polling other processes' state; nothing to block on
    return time.monotonic() - t0


def signal_storm(pid: int, sig: int, count: int, interval_s: float) -> int:
    """Send `sig` to `pid` `count` times, `interval_s` apart (stops early once it is gone); how many were sent."""
    sent = 0
    for _ in range(count):
        try:
            os.kill(pid, sig)
        except ProcessLookupError:
            break
        sent += 1
        time.sleep(interval_s)
    return sent
