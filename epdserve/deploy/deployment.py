"""`Deployment`: one mode's processes on this machine — MM Store, scheduler, instances.

Start order: the MM Store (a private Redis-protocol server unless a URL is given) → the
scheduler (`epdserve scheduler`, its address read from --address-file) → every instance
(`epdserve instance --scheduler ...`), all at once → wait until each instance is on the
scheduler's roster and HEALTHY. Stop order is the reverse: instances (in parallel), scheduler,
store. Children are `ChildProcess`es (own process group, die with the launcher) whose output
goes to one log file each under `log_dir`.

Watching: the scheduler exiting is fatal (`watch()` reports it); an instance exiting is not —
the scheduler retries its requests elsewhere — and is logged once with its log's tail.
"""
from __future__ import annotations

import logging
import os
import shutil
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import grpc

from epdserve.deploy.procs import ChildProcess, stop_all
from epdserve.instance.roles import mode_pools

log = logging.getLogger(__name__)


@dataclass
class DeploymentSpec:
    mode: str
    model: str
    encode: int = 1
    prefill: int = 1
    decode: int = 1
    mm_store: str | None = None  # None: a private local server
    host: str = "127.0.0.1"
    port: int = 0  # scheduler's public port; 0: a free one
    device: str = "cpu"
    devices: list[str] = field(default_factory=list)  # accelerator ids handed out round-robin (default: all visible)
    pin_instances: bool = False  # CPU: give each instance a disjoint share of this machine's cores
    instance_args: list[str] = field(default_factory=list)  # extra `epdserve instance` flags
    scheduler_args: list[str] = field(default_factory=list)  # extra `epdserve scheduler` flags
    log_dir: str | None = None  # None: a temporary directory, removed after a clean stop
    log_level: str = "INFO"
    ready_timeout_s: float = 600.0

    def pools(self):
        return mode_pools(self.mode, self.encode, self.prefill, self.decode)


class LaunchError(RuntimeError):
    pass


class Deployment:
    def __init__(self, spec: DeploymentSpec):
        self.spec = spec
        self.pools = spec.pools()
        self.address = ""
        self.mm_store_url = spec.mm_store or ""
        self.scheduler: ChildProcess | None = None
        self.instances: list[ChildProcess] = []
        self._redis = None
        self._own_log_dir = spec.log_dir is None
        self.log_dir = Path(spec.log_dir or tempfile.mkdtemp(prefix="epdserve-launch-"))
        self.log_dir.mkdir(parents=True, exist_ok=True)
        self._reported: set[str] = set()

    # ---------------------------------------------------------------- start
    def start(self, should_stop=lambda: False) -> str:
        """Start everything and wait until every instance serves; returns the scheduler address."""
        s = self.spec
        deadline = time.monotonic() + s.ready_timeout_s
        if not s.mm_store:
            from epdserve.transfer.mm_store.server import LocalRedisServer

            self._redis = LocalRedisServer().start()
            self.mm_store_url = self._redis.url
            log.info("MM Store: private server at %s", self.mm_store_url)
        addr_file = self.log_dir / "scheduler.address"
        addr_file.unlink(missing_ok=True)
        self.scheduler = self._child("scheduler", [
            "--model", s.model, "--host", s.host, "--port", str(s.port), "--mode", s.mode,
            "--address-file", str(addr_file), *s.scheduler_args],
            module="epdserve.entrypoints.scheduler_cli").start()
        while not addr_file.exists():
            self._check_alive(self.scheduler, "the scheduler")
            self._check_deadline(deadline, should_stop, "the scheduler to bind")
            time.sleep(0.1)  # polling a child's address file; nothing to block on
        self.address = addr_file.read_text().strip()
        cores = self._core_sets()
        k = 0
        for pool in self.pools:
            for i in range(pool.count):
                argv = self._instance_argv(pool.roles)
                if cores:
                    argv += ["--cores", ",".join(map(str, cores[k]))]
                self.instances.append(self._child(f"{pool.roles}{i}", argv, self._env(k)))
                k += 1
        for c in self.instances:
            c.start()
        self._wait_roster(deadline, should_stop)
        return self.address

    def _instance_argv(self, roles: str) -> list[str]:
        s = self.spec
        return ["instance", "--roles", roles, "--model", s.model, "--scheduler", self.address,
                "--mm-store", self.mm_store_url, "--device", s.device, "--host", s.host, *s.instance_args]

    def _core_sets(self) -> list[list[int]] | None:
        """One core set per instance (in start order) when pinning CPU instances, else None."""
        if not (self.spec.pin_instances and self.spec.device.startswith("cpu")):
            return None
        from epdserve.instance.affinity import split_cores

        weights = [float(len(p.roles)) for p in self.pools for _ in range(p.count)]  # EP needs more than D
        return split_cores(len(weights), weights=weights)

    def _env(self, k: int) -> dict[str, str]:
        if self.spec.device.startswith("cpu"):
            # Several torch processes share the cores: OpenMP threads that spin while waiting
            # steal them from the other processes (measured 5-20x slower decode on 2 cores).
            return {} if "OMP_WAIT_POLICY" in os.environ else {"OMP_WAIT_POLICY": "PASSIVE"}
        from epdserve.platform import get_platform

        return instance_device_env(get_platform(self.spec.device.split(":")[0]), self.spec.devices, k)

    def _child(self, name: str, argv: list[str], env: dict[str, str] | None = None,
               module: str | None = None) -> ChildProcess:
        stream = open(self.log_dir / f"{name}.log", "a", buffering=1)  # closed in stop()
        if module is not None:  # the scheduler's own entry point (it has no --log-level)
            return ChildProcess(name, argv, env=env, log_stream=stream, prefix="", module=module)
        return ChildProcess(name, ["--log-level", self.spec.log_level, *argv], env=env, log_stream=stream, prefix="")

    def _wait_roster(self, deadline: float, should_stop) -> None:
        from epdserve.rpc import common_pb2, serve_pb2, serve_pb2_grpc

        want = len(self.instances)
        with grpc.insecure_channel(self.address) as ch:
            stub = serve_pb2_grpc.EPDServeStub(ch)
            while True:
                self._check_alive(self.scheduler, "the scheduler")
                for c in self.instances:
                    self._check_alive(c, f"instance {c.name}")
                try:
                    info = stub.GetServerInfo(serve_pb2.GetServerInfoRequest(), timeout=2.0)
                    if sum(1 for i in info.instances if i.health == common_pb2.HEALTHY) >= want:
                        return
                except grpc.RpcError:
                    pass
                self._check_deadline(deadline, should_stop, f"{want} instances to register")
                time.sleep(0.2)  # polling the roster while the instances load their models

    def _check_alive(self, c: ChildProcess, what: str) -> None:
        if c.poll() is not None:
            raise LaunchError(f"{what} exited with code {c.poll()} while starting:\n{self.tail(c)}")

    @staticmethod
    def _check_deadline(deadline: float, should_stop, what: str) -> None:
        if should_stop():
            raise KeyboardInterrupt
        if time.monotonic() > deadline:
            raise LaunchError(f"timed out waiting for {what}")

    # ---------------------------------------------------------------- run
    def watch(self) -> str | None:
        """Check the children once: a reason to stop (the scheduler died), else None."""
        if self.scheduler is not None and self.scheduler.poll() is not None:
            return f"the scheduler exited with code {self.scheduler.poll()}:\n{self.tail(self.scheduler)}"
        for c in self.instances:
            if c.poll() is not None and c.name not in self._reported:
                self._reported.add(c.name)
                log.warning("instance %s (pid %s) exited with code %s; its requests are retried elsewhere:\n%s",
                            c.name, c.pid, c.poll(), self.tail(c))
        return None

    def tail(self, c: ChildProcess, n: int = 15) -> str:
        try:
            lines = (self.log_dir / f"{c.name}.log").read_text(errors="replace").splitlines()
        except OSError:
            return ""
        return "\n".join(f"  [{c.name}] {line}" for line in lines[-n:])

    def summary(self) -> str:
        return ",".join(f"{p.roles}x{p.count}" for p in self.pools)

    # ---------------------------------------------------------------- stop
    def stop(self, timeout_s: float = 15.0, clean: bool = True) -> None:
        stop_all(self.instances, timeout_s)
        if self.scheduler is not None:
            self.scheduler.stop(timeout_s)
        for c in [*self.instances, *([self.scheduler] if self.scheduler else [])]:
            try:
                c.log_stream.close()
            except OSError:
                pass
        if self._redis is not None:
            self._redis.stop()
            self._redis = None
        if clean and self._own_log_dir:
            shutil.rmtree(self.log_dir, ignore_errors=True)


def instance_device_env(platform, devices: list[str], k: int) -> dict[str, str]:
    """The visible-devices variable of the k-th instance (start order): its own accelerator.

    Instances are separate processes that the mode does not co-locate, so by default each gets a
    device of its own, round-robin over `devices` or, when none are named, over every device the
    platform sees (co-located workers share their instance's device). Without a variable to set
    (CPU), nothing."""
    var = platform.visible_devices_env
    if not var:
        return {}
    ids = list(devices) or [str(i) for i in range(platform.device_count())]
    return {var: ids[k % len(ids)]} if ids else {}
