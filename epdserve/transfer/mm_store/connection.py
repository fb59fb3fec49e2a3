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

Topologies (urls.py, topology.py): one server, a Redis Cluster or a Sentinel-watched primary
share one `ServerHealth`: a call that fails on any node (a master down, slots uncovered, no
primary elected yet) backs the whole store off and requests recompute until it answers again.
With replicas that is one failover (cluster-node-timeout, or Sentinel's down-after-milliseconds
plus the election); a master lost for good with no replica keeps failing calls on its slots,
so the store flaps between up and down: a failure within `quiet_s` of the last recovery is
logged at DEBUG, not as a new warning, so a flapping store warns once. The cluster client is
made on first use (redis-py's connects at construction, and the store may be down then).
"""
from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Callable
from typing import TypeVar

import redis

from epdserve.transfer.mm_store import topology
from epdserve.transfer.mm_store.urls import parse, redact

logger = logging.getLogger(__name__)
T = TypeVar("T")

# The server's password / ACL user when the URL carries none: keeps the password out of command
# lines (`ps`) and logs. `epdserve launch` sets it for its private server's instances.
PASSWORD_ENV = "EPDSERVE_MM_STORE_PASSWORD"
USERNAME_ENV = "EPDSERVE_MM_STORE_USERNAME"
CONNECTION_ERRORS = (redis.ConnectionError, redis.TimeoutError, OSError, *topology.UNAVAILABLE_ERRORS)


class StoreUnavailableError(ConnectionError):
    """The MM Store server cannot be reached now (down, or backing off after a failure)."""


class ServerHealth:
    """Up/down state of one server with exponential backoff; logs transitions only."""

    def __init__(self, name: str, backoff_s: float = 0.5, max_backoff_s: float = 8.0,
                 clock: Callable[[], float] = time.monotonic, quiet_s: float = 60.0):
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
        self._quiet_s = quiet_s
        self._recovered_at: float | None = None
        self._flapping = False
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
            self._recovered_at = self._clock()
            flapping = self._flapping
        logger.log(logging.DEBUG if flapping else logging.INFO, "MM Store %s is reachable again; using it", self.name)

    def record_failure(self, error: BaseException) -> bool:
        """Returns True when this failure took the server from up to down."""
        with self._lock:
            was_up = self._up
            now = self._clock()
            if was_up:
                self._up = False
                self._up_event.clear()
                self._backoff = self._base
                self.outages += 1
                self._flapping = self._recovered_at is not None and now - self._recovered_at < self._quiet_s
            else:
                self._backoff = min(self._backoff * 2, self._max)
            self._retry_at = now + self._backoff
            flapping = self._flapping
        if was_up and flapping:
            logger.debug("MM Store %s failed again within %.0f s of recovering (%s: %s)", self.name,
                         self._quiet_s, type(error).__name__, error)
        elif was_up:
            logger.warning(
                "MM Store %s is unreachable (%s: %s); features are recomputed locally until it is back",
                self.name, type(error).__name__, error,
            )
        return was_up


class RedisConnection:
    """A redis-py client (hiredis parser when installed) for one MM Store URL plus its `ServerHealth`.

    `call(fn)` runs ``fn(client)`` and turns connection failures into `StoreUnavailableError`.
    ``url``: redis://, rediss://, unix://, or a cluster / Sentinel URL (urls.py).
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
        self.topology = parse(url)  # ValueError for an unknown scheme
        if socket_timeout_s <= 0 or connect_timeout_s <= 0:
            raise ValueError("socket and connect timeouts must be positive")
        self.url = url
        self.socket_timeout_s = socket_timeout_s
        self.connect_timeout_s = connect_timeout_s
        self.health = ServerHealth(redact(url), backoff_s, max_backoff_s, clock)
        self._lock = threading.Lock()
        self._client = None

    @property
    def kind(self) -> str:
        """"single", "cluster" or "sentinel" (urls.py)."""
        return self.topology.kind

    @property
    def client(self):
        """The shared client, made on first use (raises like a call when a cluster is unreachable)."""
        with self._lock:
            if self._client is None:
                self._client = self._make_client(self.socket_timeout_s)
            return self._client

    def _make_client(self, socket_timeout_s: float):
        auth = {}  # the URL's own user/password win (redis-py lets URL options override these)
        if os.environ.get(PASSWORD_ENV):
            auth["password"] = os.environ[PASSWORD_ENV]
        if os.environ.get(USERNAME_ENV):
            auth["username"] = os.environ[USERNAME_ENV]
        return topology.make_client(self.topology, socket_timeout_s=socket_timeout_s,
                                    connect_timeout_s=self.connect_timeout_s, auth=auth, extra=_zero_copy_packer())

    def blocking_client(self, block_s: float):
        """A separate client for blocking reads (XREAD BLOCK): its timeout exceeds the block.
        Connects (a cluster's) when made: make it where connection errors are handled."""
        return self._make_client(block_s + self.socket_timeout_s)

    def call(self, fn: Callable[[redis.Redis], T]) -> T:
        if not self.health.allow():
            raise StoreUnavailableError(f"MM Store {self.health.name} is down (next retry in "
                                        f"{self.health.retry_in():.2f} s)")
        try:
            result = fn(self.client)
        except (*CONNECTION_ERRORS, AttributeError) as e:
            if isinstance(e, AttributeError) and not _socket_closed_under_call(e):
                raise
            if self.health.record_failure(e) and self._client is not None:
                topology.reset(self._client)  # no stale sockets once it is back
            raise StoreUnavailableError(f"MM Store {self.health.name} is unreachable: {e}") from e
        self.health.record_success()
        return result

    def close(self) -> None:
        with self._lock:
            client, self._client = self._client, None
        if client is not None:
            client.close()


def _socket_closed_under_call(e: AttributeError) -> bool:
    """A call whose connection another thread disconnected mid-command: the failure reset above
    (`topology.reset`, in the thread that saw the server go) closes the pools' sockets, and a
    redis-py connection in use elsewhere then meets its socket as None inside redis-py
    ("'NoneType' object has no attribute 'sendall'", seen with a cluster master killed under
    load). That is the server being unreachable, not a bug of ours: only an AttributeError raised
    in redis-py's own code on None counts."""
    tb = e.__traceback__
    while tb is not None and tb.tb_next is not None:
        tb = tb.tb_next
    where = tb.tb_frame.f_code.co_filename if tb is not None else ""
    return "'NoneType' object" in str(e) and f"{os.sep}redis{os.sep}" in where


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
