"""The faults of `epdserve bench chaos`: find a launched deployment's processes, kill one with
SIGKILL, wait until the launcher brought it back and the scheduler's roster is whole again, and
check afterwards that no process and no listening port is left.

Processes are the launcher's children, told apart by their command lines: "scheduler" (the
scheduler_cli module), "mm_store" (the Valkey / redis-server binary) and one entry per instance
("E", "P", "D", "EP", ...: its --roles).
"""
from __future__ import annotations

import os
import signal
import socket
import time
from dataclasses import dataclass

import psutil

from epdserve.roles import STAGES
from epdserve.rpc import common_pb2


def children(launcher_pid: int) -> list[tuple[str, psutil.Process]]:
    """(kind, process) of each live child of the launcher."""
    out = []
    for p in psutil.Process(launcher_pid).children():
        try:
            if p.status() == psutil.STATUS_ZOMBIE:
                continue
            cmd = p.cmdline()
        except psutil.NoSuchProcess:
            continue
        line = " ".join(cmd)
        if "scheduler_cli" in line:
            out.append(("scheduler", p))
        elif "valkey" in line or "redis-server" in line:
            out.append(("mm_store", p))
        elif "--roles" in cmd:
            out.append((cmd[cmd.index("--roles") + 1], p))
    return out


def pick(launcher_pid: int, target: str) -> psutil.Process | None:
    """A process to kill for `target`: "scheduler", "mm_store", or a role (an instance whose roles
    are exactly it, else one that includes it)."""
    kids = children(launcher_pid)
    for exact in (True, False):
        for kind, p in kids:
            if kind == target or (not exact and target in STAGES and target in kind
                                  and kind not in ("scheduler", "mm_store")):
                return p
    return None


def kill(p: psutil.Process) -> None:
    try:
        os.kill(p.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass


def healthy_pids(address: str, cluster_token: str) -> list[int] | None:
    """The pids of the instances the scheduler sees HEALTHY (None: no scheduler answers); pids,
    like addresses, are shown only to a holder of the deployment's cluster token."""
    import grpc

    from epdserve.rpc import serve_pb2, serve_pb2_grpc
    from epdserve.security import Secret
    from epdserve.security.interceptors import cluster_metadata

    try:
        with grpc.insecure_channel(address) as ch:
            info = serve_pb2_grpc.EPDServeStub(ch).GetServerInfo(
                serve_pb2.GetServerInfoRequest(), timeout=3, metadata=cluster_metadata(Secret(cluster_token)))
        return [i.pid for i in info.instances if i.health == common_pb2.HEALTHY]
    except grpc.RpcError:
        return None


@dataclass
class Back:
    process_s: float  # until a new process of the killed kind runs
    roster_s: float  # until the scheduler sees every instance HEALTHY again


def wait_back(launcher_pid: int, address: str, cluster_token: str, kind: str, before: set[int], instances: int,
              t0: float,
              timeout_s: float = 120.0) -> Back | None:
    """Wait until a new process of the killed `kind` runs (a pid not in `before`, the pids of that
    kind at the kill) and the roster is whole again — `instances` HEALTHY, the new one among them
    when it is an instance; None on timeout."""
    process_s, new = None, None
    while time.monotonic() - t0 < timeout_s:
        if new is None:
            new = next((p.pid for k, p in children(launcher_pid) if k == kind and p.pid not in before), None)
            if new is not None:
                process_s = time.monotonic() - t0
        if new is not None:
            pids = healthy_pids(address, cluster_token) or []
            if len(pids) >= instances and (kind in ("scheduler", "mm_store") or new in pids):
                return Back(process_s, time.monotonic() - t0)
        time.sleep(0.2)  # polling other processes' state
    return None


def listening_ports(procs: list[psutil.Process]) -> set[tuple[str, int]]:
    out = set()
    for p in procs:
        try:
            out |= {(c.laddr.ip, c.laddr.port) for c in p.net_connections("tcp") if c.status == psutil.CONN_LISTEN}
        except psutil.Error:
            pass
    return out


def leftovers(pids: set[int], ports: set[tuple[str, int]], within_s: float = 0.0
              ) -> tuple[list[int], list[tuple[str, int]]]:
    """Processes still running and ports still accepting connections, of those seen during a run,
    once none is left or `within_s` has passed."""
    deadline = time.monotonic() + within_s
    while True:
        alive, open_ports = _leftovers(pids, ports)
        if not (alive or open_ports) or time.monotonic() >= deadline:
            return alive, open_ports
        time.sleep(0.2)  # polling other processes' exit


def _leftovers(pids, ports):
    alive = []
    for pid in pids:
        try:
            if psutil.Process(pid).status() != psutil.STATUS_ZOMBIE:
                alive.append(pid)
        except psutil.NoSuchProcess:
            pass
    open_ports = []
    for host, port in ports:
        with socket.socket() as s:
            s.settimeout(0.5)
            if s.connect_ex((host if host not in ("0.0.0.0", "::") else "127.0.0.1", port)) == 0:
                open_ports.append((host, port))
    return sorted(alive), sorted(open_ports)
