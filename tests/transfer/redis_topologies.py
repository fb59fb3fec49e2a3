"""Test harness: Redis topologies of real `redis-server` processes on loopback, password-protected.

- `RedisClusterProcesses`: N masters (cluster-enabled), joined by `redis-cli --cluster create`
  (no slot assignment written here), `cluster-require-full-coverage no` (a cache: losing one
  master loses its slots, the others keep serving) and a short `cluster-node-timeout`;
  `kill(i)` SIGKILLs one master.
- `RedisSentinelProcesses`: one primary, one replica, one sentinel watching them (`redis-server
  --sentinel`); `kill_primary()` SIGKILLs the primary so the sentinel promotes the replica.

Each process gets its own config file (0600, in a temporary 0700 directory: the password stays out
of argv) and a free port (epdserve.net.free_port); the password also travels to redis-cli in
REDISCLI_AUTH, never on its command line. Needs Debian's redis-server and redis-cli on PATH.
"""
from __future__ import annotations

import os
import shutil
import signal
import subprocess
import tempfile
import time
from pathlib import Path

import redis

from epdserve.net import free_port

HOST = "127.0.0.1"


def have_redis_tools() -> bool:
    return bool(shutil.which("redis-server") and shutil.which("redis-cli"))


def _wait(cond, timeout_s: float, what: str):
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            value = cond()
        except (redis.RedisError, OSError):
            value = None
        if value:
            return value
        time.sleep(0.05)
    raise TimeoutError(f"timed out waiting for {what}")


class _Processes:
    def __init__(self, password: str):
        self.password = password
        self._dir = tempfile.TemporaryDirectory(prefix="epdserve-redis-topology-")
        self.procs: dict[int, subprocess.Popen] = {}

    def _spawn(self, name: str, port: int, lines: list[str], sentinel: bool = False) -> None:
        conf = Path(self._dir.name) / f"{name}.conf"
        conf.write_text("\n".join([f"port {port}", f"bind {HOST}", f"dir {self._dir.name}", 'save ""',
                                   "appendonly no", f"logfile {self._dir.name}/{name}.log", *lines]) + "\n")
        conf.chmod(0o600)
        args = [shutil.which("redis-server"), str(conf)] + (["--sentinel"] if sentinel else [])
        self.procs[port] = subprocess.Popen(args, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                                            stderr=subprocess.DEVNULL, start_new_session=True)

    def _client(self, port: int, **kw) -> redis.Redis:
        return redis.Redis(host=HOST, port=port, socket_timeout=2, socket_connect_timeout=2, **kw)

    def _kill(self, port: int) -> None:
        proc = self.procs.pop(port)
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()

    def stop(self) -> None:
        for port in list(self.procs):
            self._kill(port)
        self._dir.cleanup()

    def __enter__(self):
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()

    def start(self):
        raise NotImplementedError


class RedisClusterProcesses(_Processes):
    def __init__(self, masters: int = 3, password: str = "cluster-secret", node_timeout_ms: int = 5000):
        super().__init__(password)
        self.masters = masters
        self.node_timeout_ms = node_timeout_ms
        self.ports: list[int] = []

    def start(self) -> "RedisClusterProcesses":
        self.ports = [free_port(HOST) for _ in range(self.masters)]
        for i, port in enumerate(self.ports):
            self._spawn(f"node{i}", port, [  # cluster-port: the bus on a free port too (default: port+10000)
                "cluster-enabled yes", f"cluster-port {free_port(HOST)}", f"cluster-config-file nodes-{port}.conf",
                f"cluster-node-timeout {self.node_timeout_ms}", "cluster-require-full-coverage no",
                f'requirepass "{self.password}"', f'masterauth "{self.password}"'])
        for port in self.ports:
            _wait(lambda p=port: self._client(p, password=self.password).ping(), 10, f"node {port}")
        subprocess.run(["redis-cli", "--cluster", "create", *[f"{HOST}:{p}" for p in self.ports],
                        "--cluster-replicas", "0", "--cluster-yes"], check=True, capture_output=True,
                       env={**os.environ, "REDISCLI_AUTH": self.password}, timeout=60)
        for port in self.ports:
            _wait(lambda p=port: self._settled(p), 30, f"node {port} to see the whole cluster")
        return self

    def cluster_info(self, port: int) -> dict[str, str]:
        info = self._client(port, password=self.password, decode_responses=True).execute_command("CLUSTER INFO")
        return info if isinstance(info, dict) else dict(line.split(":", 1) for line in info.split() if ":" in line)

    def _settled(self, port: int) -> bool:
        """This node knows every master and sees all 16384 slots served (its CLUSTER INFO)."""
        info = self.cluster_info(port)
        return (info["cluster_state"] == "ok" and int(info["cluster_slots_ok"]) == 16384
                and int(info["cluster_known_nodes"]) == self.masters)

    def url(self, with_password: bool = True) -> str:
        auth = f":{self.password}@" if with_password else ""
        return f"redis+cluster://{auth}" + ",".join(f"{HOST}:{p}" for p in self.ports)

    def kill(self, index: int) -> int:
        """SIGKILL master ``index``; returns its port."""
        port = self.ports[index]
        self._kill(port)
        return port


class RedisSentinelProcesses(_Processes):
    service = "epdmaster"

    def __init__(self, password: str = "sentinel-secret"):
        super().__init__(password)
        self.primary = self.replica = self.sentinel = 0

    def start(self) -> "RedisSentinelProcesses":
        self.primary, self.replica, self.sentinel = (free_port(HOST) for _ in range(3))
        auth = [f'requirepass "{self.password}"', f'masterauth "{self.password}"']
        self._spawn("primary", self.primary, auth)
        self._spawn("replica", self.replica, [*auth, f"replicaof {HOST} {self.primary}"])
        _wait(lambda: b"master_link_status:up" in self._client(self.replica, password=self.password)
              .execute_command("INFO replication"), 30, "the replica's link")
        self._spawn("sentinel", self.sentinel, [
            f"sentinel monitor {self.service} {HOST} {self.primary} 1",
            f'sentinel auth-pass {self.service} "{self.password}"',
            f"sentinel down-after-milliseconds {self.service} 2000",  # shorter: a loaded host fails over by itself
            f"sentinel failover-timeout {self.service} 5000"], sentinel=True)
        _wait(lambda: self.primary_port() == self.primary, 10, "the sentinel to see the primary")
        return self

    def primary_port(self) -> int | None:
        addr = self._client(self.sentinel).execute_command("SENTINEL GET-MASTER-ADDR-BY-NAME", self.service)
        return int(addr[1]) if addr else None

    def url(self, with_password: bool = True) -> str:
        auth = f":{self.password}@" if with_password else ""
        return f"redis+sentinel://{auth}{HOST}:{self.sentinel}/{self.service}"

    def kill_primary(self, timeout_s: float = 60.0) -> None:
        """SIGKILL the primary and wait until the sentinel names the replica instead."""
        self._kill(self.primary)
        _wait(lambda: self.primary_port() == self.replica, timeout_s, "the sentinel's failover")
