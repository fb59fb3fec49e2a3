"""`Deployment`: one mode's processes on this machine — MM Store, scheduler, instances.

Start order: the MM Store (a private Redis-protocol server unless a URL is given) → the
scheduler (`epdserve scheduler`, its address read from --address-file) → every instance
(`epdserve instance --scheduler ...`), all at once → wait until each instance is on the
scheduler's roster and HEALTHY. Stop order is the reverse: instances (in parallel), scheduler,
store. The readiness probe (`readiness.RosterProbe`) uses the credentials the deployment
hands out (public TLS, API key, cluster token) and, on timeout, says what it saw. Every
deployment has a cluster token — EPDSERVE_CLUSTER_TOKEN when the launcher has one, else a random
one made here — handed to each child in its environment (never its argv), so that the
scheduler's internal port and every instance port refuse callers without it, even on loopback
(other users of the machine). Likewise the deployment's media-key secret (`seams.media_keys`:
EPDSERVE_MEDIA_KEY_SECRET when the launcher has one, else a random one made here, kept in a 0600
file) goes to the scheduler, the one child that computes media keys; a restarted scheduler keys
media as before, so the MM Store's features are found again. Children are
`ChildProcess`es (own process group, die with the launcher) whose output
goes to one log file each under `log_dir`.

Supervising (`watch()`, called from the launcher's main thread, so that PR_SET_PDEATHSIG holds
for restarted children too): a child that exits — an instance, the scheduler, the private MM
Store server — is logged with its log's tail and started again after a capped exponential
backoff (`supervisor.RestartPolicy`). The scheduler comes back on the port it had, and the
instances register with it again (their heartbeat learns it forgot them); the MM Store comes back
on its port, empty (P recomputes features it misses); an instance comes back on a new port and
registers itself. Meanwhile the scheduler retries requests elsewhere. A child in a crash loop is
reported and left dead; for the scheduler that ends the deployment (`watch()` says why).
"""
from __future__ import annotations

import dataclasses
import logging
import os
import secrets
import shutil
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

from epdserve.deploy.local.argv import last_flag
from epdserve.deploy.local.kv_hop import KvHopChoice, choose_kv_hop
from epdserve.deploy.local.procs import ChildProcess, stop_all
from epdserve.deploy.local.signals import INSTANCE_STOP_MARGIN_S
from epdserve.deploy.local.supervisor import RESTART_EXIT_CODE, RestartPolicy, RestartSchedule
from epdserve.engine.config import EngineConfig
from epdserve.instance.modes import mode_pools, pool_degree, pool_degrees
from epdserve.seams.media_keys import MEDIA_KEY_SECRET_ENV
from epdserve.security.secrets import CLUSTER_TOKEN_ENV
from epdserve.platform.dtype_default import resolve_dtype
from epdserve.settings import env_value, same_as
from epdserve.transfer.mm_store.connection import PASSWORD_ENV
from epdserve.transfer.mm_store.urls import SENTINEL_PASSWORD_ENV, without_secrets

log = logging.getLogger(__name__)


@dataclass
class DeploymentSpec:
    mode: str
    model: str
    encode: int = 1
    prefill: int = 1
    decode: int = 1
    mm_store: str | None = None  # None: a private local server
    mm_store_max_bytes: int = 4 << 30  # the private server's memory bound (LRU eviction)
    host: str = "127.0.0.1"
    port: int = 0  # scheduler's public port; 0: a free one
    device: str = same_as(EngineConfig, "device")  # resolved to this machine's platform by Deployment
    devices: list[str] = field(default_factory=list)  # accelerator ids handed out round-robin (default: all visible)
    pin_instances: bool = False  # CPU: give each instance a disjoint share of this machine's cores
    planned: str | None = None  # --mode auto: what the planner chose, and why (logged)
    demo_model: bool = False  # `model` is launch's built-in random-weight demo (the ready line says so)
    instance_args: list[str] = field(default_factory=list)  # extra `epdserve instance` flags
    scheduler_args: list[str] = field(default_factory=list)  # extra `epdserve scheduler` flags
    registry: str | None = None  # host:port instances register at (the scheduler's internal port, set in
    # its scheduler_args); None: a port of `host` the scheduler binds itself (a restarted one comes back on it)
    log_dir: str | None = None  # None: a temporary directory, removed after a clean stop
    log_level: str = "INFO"
    ready_timeout_s: float = 600.0
    drain_timeout_s: float = 10.0  # instances' --drain-timeout: calls in flight finish within it on stop
    encode_tensor_parallel_size: int = 1  # E-only instances' degree (the rest: --tensor-parallel-size in instance_args)
    prefill_tensor_parallel_size: int = 0  # P, EP, P+E instances' degree; 0: --tensor-parallel-size
    decode_tensor_parallel_size: int = 0  # D, ED instances' degree; 0: --tensor-parallel-size
    restart: RestartPolicy = field(default_factory=RestartPolicy)

    def pools(self):
        return mode_pools(self.mode, self.encode, self.prefill, self.decode)


class LaunchError(RuntimeError):
    pass


def _store_url_and_env(url: str) -> tuple[str, dict[str, str]]:
    """`url` without its passwords, and the children's environment that carries them (so no
    child's argv, nor the ready line, shows them)."""
    if not url:
        return "", {}
    clean, password, sentinel = without_secrets(url)
    env = {name: v for name, v in ((PASSWORD_ENV, password), (SENTINEL_PASSWORD_ENV, sentinel)) if v}
    if env:
        log.warning("the MM Store URL's password was moved to the instances' environment; this launcher's own "
                    "command line still shows it: set %s (and %s) instead", PASSWORD_ENV, SENTINEL_PASSWORD_ENV)
    return clean, env


class Deployment:
    def __init__(self, spec: DeploymentSpec):
        from epdserve.platform import resolve_device

        self.spec = dataclasses.replace(spec, device=resolve_device(spec.device))  # "auto" -> its platform
        # `--dtype auto` resolved once, here: every instance gets the same (platform/dtype_default.py)
        given = last_flag(spec.instance_args, "--dtype") or env_value(EngineConfig, "dtype")
        self.dtype, why = resolve_dtype(given, self.spec.device.partition(":")[0])
        log.info("instances run %s (%s)", self.dtype, why)
        # each instance's tensor-parallel degree (E-only, prefill-only, decode-only pools their own): that
        # many devices each
        self._degree = int(last_flag(spec.instance_args, "--tensor-parallel-size") or 1)
        self.pools = spec.pools()
        # ValueError before anything starts for a P->D pair of degrees the KV hop does not carry
        per_pool = pool_degrees(self.pools, *self._stage_degrees())
        self._degrees = [d for p, d in zip(self.pools, per_pool) for _ in range(p.count)]
        self.address = ""
        # the MM Store URL children get and the ready line shows: never its passwords, which go to
        # the instances' environment (`urls.without_secrets`)
        self.mm_store_url, self._store_env = _store_url_and_env(spec.mm_store or "")
        self.scheduler: ChildProcess | None = None
        self.registry = spec.registry or ""  # host:port instances register at; unless given, once the scheduler bound it
        self._internal_port = 0  # ours (no spec.registry): 0 until the scheduler binds one, then that one
        self.http_port: int | None = None  # the OpenAI front's port once the scheduler bound it (kept for restarts)
        self.instances: list[ChildProcess] = []
        self._redis = None
        # the deployment's cluster token: the launcher's, else a random one (children get it in their environment)
        self.cluster_token = os.environ.get(CLUSTER_TOKEN_ENV) or secrets.token_urlsafe(32)
        self.cluster_token_file: Path | None = None  # where a token made here is kept (0600)
        # the secret media keys are keyed with: the launcher's, else a random one (the scheduler's environment)
        self.media_key_secret = os.environ.get(MEDIA_KEY_SECRET_ENV, "").strip() or secrets.token_urlsafe(32)
        self.media_key_secret_file: Path | None = None  # where a secret made here is kept (0600)
        self.mm_store_password_file: Path | None = None  # the private MM Store's password, for operators' tools
        self._own_log_dir = spec.log_dir is None
        self.log_dir = Path(spec.log_dir or tempfile.mkdtemp(prefix="epdserve-launch-"))
        self.log_dir.mkdir(parents=True, exist_ok=True)
        self._instance_launches: list[tuple[str, list[str], dict[str, str]]] = []  # name, argv, env
        self._schedules: dict[str, RestartSchedule] = {}  # child name ("mm_store", "scheduler", instances)
        self.kv_hop: KvHopChoice | None = None  # the P->D KV hop, chosen at start (deploy/kv_hop.py)

    # ---------------------------------------------------------------- start
    def start(self, should_stop=lambda: False) -> str:
        """Start everything and wait until every instance serves; returns the scheduler address."""
        s = self.spec
        deadline = time.monotonic() + s.ready_timeout_s
        if not s.mm_store:
            from epdserve.transfer.mm_store.server import LocalRedisServer

            # a password even on loopback (other local users); instances get it from the environment
            self._redis = LocalRedisServer(maxmemory=s.mm_store_max_bytes, password=secrets.token_urlsafe(24)).start()
            self.mm_store_url = self._redis.address_url
            self.mm_store_password_file = self._write_secret("mm_store.password", self._redis.password)
            log.info("MM Store: private server at %s", self.mm_store_url)
        if CLUSTER_TOKEN_ENV not in os.environ:  # made here: kept where the operator can read it
            self.cluster_token_file = self._write_secret("cluster.token", self.cluster_token)
        if not os.environ.get(MEDIA_KEY_SECRET_ENV, "").strip():
            self.media_key_secret_file = self._write_secret("media_key.secret", self.media_key_secret)
        self.address = self._start_scheduler(deadline, should_stop)
        cores = self._core_sets()
        self.kv_hop = self._choose_kv_hop()
        if self.kv_hop.hop != "none":
            log.info("KV hop P->D: %s (%s)", self.kv_hop.hop, self.kv_hop.why)
        k = 0
        for pool in self.pools:
            for i in range(pool.count):
                argv = self._instance_argv(pool.roles)
                if self.kv_hop.forced:
                    argv += ["--kv-hop", self.kv_hop.forced]
                if cores:
                    argv += ["--cores", ",".join(map(str, cores[k]))]
                self._instance_launches.append((f"{pool.roles}{i}", argv, self._env(k)))
                k += 1
        self.instances = [self._child(*launch) for launch in self._instance_launches]
        for c in self.instances:
            c.start()
        self._wait_roster(deadline, should_stop)
        now = time.monotonic()
        for name in ["scheduler", *(c.name for c in self.instances), *(["mm_store"] if self._redis else [])]:
            self._schedules[name] = RestartSchedule(s.restart, now)
        return self.address

    def _start_scheduler(self, deadline: float, should_stop) -> str:
        """Start the scheduler and wait for the address it bound; its internal port, unless given,
        is one it binds itself (port 0: no other process can take it between a pick and the bind),
        read from its internal address file and kept for its restarts."""
        addr_file = self.log_dir / "scheduler.address"
        addr_file.unlink(missing_ok=True)
        self._http_file().unlink(missing_ok=True)
        self.scheduler = self._scheduler_child(self.spec.port, addr_file).start()
        while not addr_file.exists():
            self._check_alive(self.scheduler, "the scheduler")
            self._check_deadline(deadline, should_stop, "the scheduler to bind")
            time.sleep(0.1)  # polling a child's address file; nothing to block on
        if not self.spec.registry:  # written before the address file
            self.registry = self._internal_file().read_text().strip()
            self._internal_port = int(self.registry.rsplit(":", 1)[1])
        if self._http_file().exists():  # the HTTP front, also written before the address file
            self.http_port = int(self._http_file().read_text().strip().rsplit(":", 1)[1])
        return addr_file.read_text().strip()

    def _http_file(self) -> Path:
        return self.log_dir / "scheduler.http"

    def _http_args(self) -> list[str]:
        """With an HTTP front (`--http-port` in the scheduler's flags; 0: a port the scheduler binds
        itself, so no other process can take it between a pick and the bind), where the scheduler
        writes the address it bound, and, once bound, that port again for its restarts."""
        if last_flag(self.spec.scheduler_args, "--http-port") is None:
            return []
        again = ["--http-port", str(self.http_port)] if self.http_port else []
        return ["--http-address-file", str(self._http_file()), *again]

    def _write_secret(self, name: str, value: str) -> Path:
        """A secret the deployment made (the private MM Store's password, its cluster token, its
        media-key secret) in a
        0600 file of the log directory (removed with it after a clean stop), for tools an operator
        points at the deployment (`epdserve doctor --mm-store`, GetServerInfo with the token)."""
        path = self.log_dir / name
        path.unlink(missing_ok=True)
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(fd, "w") as f:
            f.write(value + "\n")
        return path

    def _internal_file(self) -> Path:
        return self.log_dir / "scheduler.internal"

    def _scheduler_child(self, port: int, addr_file: Path) -> ChildProcess:
        s = self.spec
        return self._child("scheduler", [
            "--model", s.model, "--host", s.host, "--port", str(port), "--mode", s.mode,
            "--address-file", str(addr_file), *self._internal_args(), *s.scheduler_args, *self._http_args()],
            env={CLUSTER_TOKEN_ENV: self.cluster_token, MEDIA_KEY_SECRET_ENV: self.media_key_secret},
            module="epdserve.entrypoints.scheduler_cli")

    def _internal_args(self) -> list[str]:
        """The scheduler flags of its internal port when the deployment owns it (no spec.registry):
        the one it bound first, so a restarted scheduler comes back where instances register."""
        if self.spec.registry:
            return []
        return ["--internal-host", self.spec.host, "--internal-port", str(self._internal_port),
                "--internal-address-file", str(self._internal_file())]

    def _stage_degrees(self) -> tuple[int, int, int, int]:
        """(language model, encode-only, prefill-only, decode-only) degrees, as `pool_degree` takes them."""
        s = self.spec
        return (self._degree, s.encode_tensor_parallel_size, s.prefill_tensor_parallel_size,
                s.decode_tensor_parallel_size)

    def _instance_argv(self, roles: str) -> list[str]:
        s = self.spec
        degree = pool_degree(roles, *self._stage_degrees())
        return ["instance", "--roles", roles, "--model", s.model, "--scheduler", self.registry,
                "--mm-store", self.mm_store_url, "--device", s.device, "--host", s.host,
                "--drain-timeout", str(s.drain_timeout_s), "--dtype", self.dtype, *s.instance_args,
                *(["--tensor-parallel-size", str(degree)] if degree != self._degree else [])]  # the last one wins

    def _choose_kv_hop(self) -> KvHopChoice:
        """The P->D hop, from each instance's roles and the accelerator it gets (start order)."""
        roles = [p.roles for p in self.pools for _ in range(p.count)]
        ids: list[str | None] = [None] * len(roles)
        if not self.spec.device.startswith("cpu"):
            ids = [next(iter(self._device_env(k).values()), None) for k in range(len(roles))]
        return choose_kv_hop(roles, ids, self.spec.device, self.spec.instance_args)

    def _core_sets(self) -> list[list[int]] | None:
        """One core set per instance (in start order) when pinning CPU instances, else None."""
        if not (self.spec.pin_instances and self.spec.device.startswith("cpu")):
            return None
        from epdserve.platform.cores import split_cores
        from epdserve.roles import role_set

        weights = [float(len(role_set(p.roles).stages)) for p in self.pools for _ in range(p.count)]  # EP > D
        return split_cores(len(weights), weights=weights)

    def _env(self, k: int) -> dict[str, str]:
        env = {CLUSTER_TOKEN_ENV: self.cluster_token, **self._store_env}
        if self._redis is not None:
            env[PASSWORD_ENV] = self._redis.password  # the private MM Store's
        return {**env, **self._device_env(k)}

    def _device_env(self, k: int) -> dict[str, str]:
        if self.spec.device.startswith("cpu"):
            # Several torch processes share the cores: OpenMP threads that spin while waiting
            # would steal them from the other processes, so PASSIVE unless the caller chose a policy
            # (README 'The serving path's cost per token'; docs/measurements.md).
            return {} if "OMP_WAIT_POLICY" in os.environ else {"OMP_WAIT_POLICY": "PASSIVE"}
        from epdserve.platform import get_platform

        return instance_device_env(get_platform(self.spec.device.split(":")[0]), self.spec.devices, k,
                                   self._degrees)

    def _child(self, name: str, argv: list[str], env: dict[str, str] | None = None,
               module: str | None = None) -> ChildProcess:
        stream = open(self.log_dir / f"{name}.log", "a", buffering=1)  # closed in stop()
        if module is not None:  # the scheduler's own entry point (it has no --log-level)
            return ChildProcess(name, argv, env=env, log_stream=stream, prefix="", module=module)
        return ChildProcess(name, ["--log-level", self.spec.log_level, *argv], env=env, log_stream=stream, prefix="")

    def _wait_roster(self, deadline: float, should_stop) -> None:
        from epdserve.deploy.local.readiness import RosterProbe
        from epdserve.rpc import serve_pb2_grpc

        # the credentials the deployment hands out: TLS when the scheduler serves its public port
        # over TLS (--tls-cert, from launch's own flag or --scheduler-args: the last one wins)
        probe = RosterProbe(self.address, len(self.instances), tls_ca=last_flag(self.spec.scheduler_args, "--tls-cert"),
                            cluster_token=self.cluster_token)
        with probe.channel() as ch:
            stub = serve_pb2_grpc.EPDServeStub(ch)
            next_note = time.monotonic() + 10.0
            while True:
                self._check_alive(self.scheduler, "the scheduler")
                for c in self.instances:
                    self._check_alive(c, f"instance {c.name}")
                if probe.poll(stub):
                    return
                if time.monotonic() >= next_note:  # the instances' own output goes to their logs: say why we wait
                    log.info("waiting for the instances (%s); a first start builds the native operators (~1 min) "
                             "and every instance loads the model; child logs in %s", probe.report(), self.log_dir)
                    next_note = time.monotonic() + 20.0
                self._check_deadline(
                    deadline, should_stop, f"{probe.want} instances to be HEALTHY on the scheduler's roster",
                    explain=lambda: f"{probe.report()}; logs in {self.log_dir}, ending:\n" + "\n".join(
                        self.tail(c, 5) for c in [self.scheduler, *self.instances]))
                time.sleep(0.2)  # polling the roster while the instances load their models

    def _check_alive(self, c: ChildProcess, what: str) -> None:
        if c.poll() is not None:
            raise LaunchError(f"{what} exited with code {c.poll()} while starting:\n{self.tail(c)}")

    def _check_deadline(self, deadline: float, should_stop, what: str, explain=None) -> None:
        """Stop on a signal; past `deadline`, fail naming `what` was awaited and (`explain()`) what was seen."""
        if should_stop():
            raise KeyboardInterrupt
        if time.monotonic() > deadline:
            seen = f": {explain()}" if explain else ""
            raise LaunchError(f"timed out after {self.spec.ready_timeout_s:.0f} s waiting for {what}{seen}")

    # ---------------------------------------------------------------- run
    def watch(self) -> str | None:
        """Check the children once, restarting the dead that are due: a reason to stop (the
        scheduler is in a crash loop), else None."""
        now = time.monotonic()
        if self._redis is not None and "mm_store" in self._schedules:
            self._supervise("mm_store", "the MM Store server", self._redis.running, now, self._restart_mm_store)
        if self.scheduler is not None and "scheduler" in self._schedules:
            if self._supervise("scheduler", "the scheduler", self.scheduler.alive(), now, self._restart_scheduler,
                               self.scheduler):
                return f"the scheduler is in a crash loop (exited {self._schedules['scheduler'].failures} times in a row)"
        for k, c in enumerate(self.instances):
            if c.name in self._schedules:
                self._supervise(c.name, f"instance {c.name}", c.alive(), now, lambda k=k: self._restart_instance(k), c)
        return None

    @property
    def restarts(self) -> dict[str, int]:
        """How many times each child was started again."""
        return {name: sch.restarts for name, sch in self._schedules.items()}

    def _supervise(self, name: str, what: str, alive: bool, now: float, restart, child: ChildProcess | None = None
                   ) -> bool:
        """One child's turn: note its death, restart it when due. True: it is in a crash loop."""
        sch = self._schedules[name]
        if sch.gave_up:
            return True
        if alive:
            return False
        if sch.due is None:
            rc = child.poll() if child is not None else None
            code = f" with code {rc}" if child is not None else ""
            if rc == RESTART_EXIT_CODE and child is not None and name not in ("mm_store", "scheduler"):
                code += " (it asked for a restart: KV blocks held by a stuck receive)"
            tail = self.tail(child) if child is not None else ""
            if child is not None:
                self._reap(child)
            delay = sch.exited(now)
            if delay is None:
                log.error("%s is in a crash loop (exited %d times in a row, each within %.0f s of its start); "
                          "not restarting it:\n%s", what, sch.failures, sch.policy.stable_after_s, tail)
                return True
            log.warning("%s exited%s; restarting it in %.1f s:\n%s", what, code, delay, tail)
            return False
        if sch.is_due(now):
            try:
                restart()
            except Exception as e:  # e.g. the MM Store port was taken: counts as another exit
                log.error("restarting %s failed: %s", what, e)
                sch.started(now)
                return False
            sch.started(now)
            log.info("%s started again (restart %d)", what, sch.restarts)
        return False

    def _reap(self, c: ChildProcess) -> None:
        c.stop(0.0)  # reaps it; SIGKILLs whatever of its process group is left
        try:
            c.log_stream.close()
        except OSError:
            pass

    def _restart_mm_store(self) -> None:
        self._redis.stop()
        self._redis.start()  # the same port, empty

    def _restart_scheduler(self) -> None:
        port = int(self.address.rsplit(":", 1)[1])  # the port it had: instances and clients know it
        addr_file = self.log_dir / "scheduler.address"
        addr_file.unlink(missing_ok=True)
        self.scheduler = self._scheduler_child(port, addr_file).start()

    def _restart_instance(self, k: int) -> None:
        self.instances[k] = self._child(*self._instance_launches[k]).start()  # same flags, cores included

    def tail(self, c: ChildProcess, n: int = 15) -> str:
        try:
            lines = (self.log_dir / f"{c.name}.log").read_text(errors="replace").splitlines()
        except OSError:
            return ""
        return "\n".join(f"  [{c.name}] {line}" for line in lines[-n:])

    def summary(self) -> str:
        return ",".join(f"{p.roles}x{p.count}" for p in self.pools)

    # ---------------------------------------------------------------- stop
    def stop(self, timeout_s: float | None = None, clean: bool = True) -> None:
        """Instances first (each within its drain timeout + margin, then SIGKILL), the scheduler, the store."""
        if timeout_s is None:
            timeout_s = self.spec.drain_timeout_s + INSTANCE_STOP_MARGIN_S
        stop_all(self.instances, timeout_s)
        if self.scheduler is not None:
            self.scheduler.stop(5.0)
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


def instance_device_env(platform, devices: list[str], k: int, degree: int | list[int] = 1) -> dict[str, str]:
    """The visible-devices variable of the k-th instance (start order): its own accelerator(s).

    Instances are separate processes that the mode does not co-locate, so by default each gets as
    many devices of its own as its tensor-parallel degree (`degree`: one for every instance, or
    each instance's in start order; rank r on the r-th device it sees): the next ones in turn over
    `devices` or, when none are named, over every device the platform sees, starting over from the
    first when too few are left (instances then share; co-located workers share their instance's
    devices). ValueError when an instance's degree exceeds the devices. Without a variable to set
    (CPU), nothing."""
    var = platform.visible_devices_env
    if not var:
        return {}
    ids = list(devices) or [str(i) for i in range(platform.device_count())]
    if not ids:
        return {}
    degrees = list(degree) if isinstance(degree, list) else [degree] * (k + 1)
    at = 0
    for i, d in enumerate(degrees[: k + 1]):
        if len(ids) < d:
            raise ValueError(f"an instance at tensor_parallel_size {d} needs {d} devices; {len(ids)} "
                             f"{'named by --devices' if devices else 'visible'}")
        if at + d > len(ids):
            at = 0
        if i == k:
            return {var: ",".join(ids[at:at + d])}
        at += d
    raise IndexError(f"instance {k}: no degree given for it")
