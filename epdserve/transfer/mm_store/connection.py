"""One Redis connection pool for the MM Store, and the health state that guards it.

Availability policy (the server may vanish at any time; requests must never hang on it):
short socket and connect timeouts, no redis-py retries, and a `ServerHealth` that, after a
failure, refuses further calls without touching the network for a backoff period (doubling up
to a cap), then lets one call probe the server. Only transitions are logged: one warning when
the server goes down, one info when it is back. Every caller (store reads and writes, event
publisher, prefetch listener) shares one `ServerHealth`, so one outage gives one warning.

`ServerHealth` is a circuit breaker, not a retry loop: it never repeats a call (a failed read
becomes a miss at once, the caller recomputes), it only decides whether the next call, from
whichever thread, may touch the network. So it is not written with tenacity, which retries one
call in place; epdserve's retry loops are (instance/registration.py, server.py's start).
"""
from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Callable
from typing import TypeVar
from urllib.parse import urlsplit, urlunsplit

import redis
from redis.backoff import NoBackoff
from redis.retry import Retry

logger = logging.getLogger(__name__)
T = TypeVar("T")

_SCHEMES = ("redis", "rediss", "unix")
# The server's password / ACL user when the URL carries none: keeps the password out of command
# lines (`ps`) and logs. `epdserve launch` sets it for its private server's instances.
PASSWORD_ENV = "EPDSERVE_MM_STORE_PASSWORD"
USERNAME_ENV = "EPDSERVE_MM_STORE_USERNAME"
_CONNECTION_ERRORS = (redis.ConnectionError, redis.TimeoutError, OSError)


class StoreUnavailableError(ConnectionError):
    """The MM Store server cannot be reached now (down, or backing off after a failure)."""


def redact(url: str) -> str:
    """``url`` without its password, for logs and errors."""
    parts = urlsplit(url)
    if parts.password is None:
        return url
    host = parts.hostname or ""
    netloc = f"{parts.username or ''}:***@{host}" + (f":{parts.port}" if parts.port else "")
    return urlunsplit(parts._replace(netloc=netloc))


class ServerHealth:
    """Up/down state of one server with exponential backoff; logs transitions only."""

    def __init__(self, name: str, backoff_s: float = 0.5, max_backoff_s: float = 8.0,
                 clock: Callable[[], float] = time.monotonic):
        if backoff_s <= 0 or max_backoff_s < backoff_s:
            raise ValueError(f"need 0 < backoff_s <= max_backoff_s, got {backoff_s}, {max_backoff_s}")
        self.name = name
        self._clock = clock  # injectable, so tests step through backoffs without sleeping
        self._base = backoff_s
        self._max = max_backoff_s
        self._lock = threading.Lock()
        self._up = True
        self._up_event = threading.Event()
        self._up_event.set()
        self._backoff = backoff_s
        self._retry_at = 0.0
        self.outages = 0

    @property
    def up(self) -> bool:
        with self._lock:
            return self._up

    def wait_up(self, timeout_s: float) -> bool:
        """Block until a call has succeeded again (True) or ``timeout_s`` passed (False)."""
        return self._up_event.wait(timeout_s)

    def allow(self) -> bool:
        """May a call go to the server now? While down, one caller per backoff period probes."""
        with self._lock:
            if self._up:
                return True
            now = self._clock()
            if now < self._retry_at:
                return False
            self._retry_at = now + self._backoff  # this caller probes; the others keep refusing
            return True

    def retry_in(self) -> float:
        """Seconds until the next probe is allowed (0 when up)."""
        with self._lock:
            return 0.0 if self._up else max(0.0, self._retry_at - self._clock())

    def record_success(self) -> None:
        with self._lock:
            if self._up:
                return
            self._up = True
            self._up_event.set()
            self._backoff = self._base
        logger.info("MM Store %s is reachable again; using it", self.name)

    def record_failure(self, error: BaseException) -> bool:
        """Returns True when this failure took the server from up to down."""
        with self._lock:
            was_up = self._up
            if was_up:
                self._up = False
                self._up_event.clear()
                self._backoff = self._base
                self.outages += 1
            else:
                self._backoff = min(self._backoff * 2, self._max)
            self._retry_at = self._clock() + self._backoff
        if was_up:
            logger.warning(
                "MM Store %s is unreachable (%s: %s); features are recomputed locally until it is back",
                self.name, type(error).__name__, error,
            )
        return was_up


class RedisConnection:
    """A redis-py client (hiredis parser when installed) plus its `ServerHealth`.

    `call(fn)` runs ``fn(client)`` and turns connection failures into `StoreUnavailableError`.
    """

    def __init__(
        self,
        url: str,
        *,
        socket_timeout_s: float = 1.0,
        connect_timeout_s: float = 0.25,
        backoff_s: float = 0.5,
        max_backoff_s: float = 8.0,
        clock: Callable[[], float] = time.monotonic,
    ):
        scheme = urlsplit(url).scheme
        if scheme not in _SCHEMES:
            raise ValueError(
                f"MM Store URL must start with redis://, rediss:// or unix://, got {redact(url)!r}"
            )
        if socket_timeout_s <= 0 or connect_timeout_s <= 0:
            raise ValueError("socket and connect timeouts must be positive")
        self.url = url
        self.socket_timeout_s = socket_timeout_s
        self.connect_timeout_s = connect_timeout_s
        self.health = ServerHealth(redact(url), backoff_s, max_backoff_s, clock)
        self.client = self._make_client(socket_timeout_s)

    def _make_client(self, socket_timeout_s: float) -> redis.Redis:
        auth = {}  # the URL's own user/password win (redis-py lets URL options override these)
        if os.environ.get(PASSWORD_ENV):
            auth["password"] = os.environ[PASSWORD_ENV]
        if os.environ.get(USERNAME_ENV):
            auth["username"] = os.environ[USERNAME_ENV]
        return redis.Redis.from_url(
            self.url,
            **auth,
            socket_timeout=socket_timeout_s,
            socket_connect_timeout=self.connect_timeout_s,
            retry=Retry(NoBackoff(), 0),  # ServerHealth does the backing off
            health_check_interval=0,
            **_zero_copy_packer(),
        )

    def blocking_client(self, block_s: float) -> redis.Redis:
        """A separate client for blocking reads (XREAD BLOCK): its timeout exceeds the block."""
        return self._make_client(block_s + self.socket_timeout_s)

    def call(self, fn: Callable[[redis.Redis], T]) -> T:
        if not self.health.allow():
            raise StoreUnavailableError(f"MM Store {self.health.name} is down (next retry in "
                                        f"{self.health.retry_in():.2f} s)")
        try:
            result = fn(self.client)
        except _CONNECTION_ERRORS as e:
            if self.health.record_failure(e):
                self.client.connection_pool.disconnect()  # no stale sockets once it is back
            raise StoreUnavailableError(f"MM Store {self.health.name} is unreachable: {e}") from e
        self.health.record_success()
        return result

    def close(self) -> None:
        self.client.close()


def _zero_copy_packer() -> dict:
    """Send big values straight from their buffer (replies are still parsed by hiredis).

    redis-py's hiredis command packer copies every argument into one new bytes object, which
    measured 3-10x slower than the send itself for a freshly encoded 7 MB value; its Python
    packer passes values above 6 kB to sendall as they are.
    """
    try:
        from redis._parsers.encoders import Encoder
        from redis.connection import PythonRespSerializer
    except ImportError:  # another redis-py layout: keep its default packer
        return {}
    return {"command_packer": PythonRespSerializer(6000, Encoder("utf-8", "strict", False).encode)}
