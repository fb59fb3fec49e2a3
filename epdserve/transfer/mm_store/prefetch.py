"""P side: a thread that turns feature events into local cache entries before prefill needs them.

Lifecycle of one event: XREAD (blocking, batched) -> skip keys already cached or in flight ->
mark the rest in flight -> one pipelined store read -> `put` each found feature into the
`LocalFeatureCache` (which wakes any request waiting on it) or `abandon` it.

The listener shares the store's `ServerHealth`: while the server is down it waits out the
backoff (without logging; the health object logs the outage once) and then resumes reading
after the last event id it processed, so events sent during a short outage are replayed.
See events.py for why this is a Stream. On a Redis Cluster the stream is one key on one master;
topology.py reads it from that node.
"""
from __future__ import annotations

import logging
import threading

import redis

from epdserve.seams.byte_lru import tensors_nbytes
from epdserve.transfer.mm_store import topology
from epdserve.transfer.mm_store.cache import LocalFeatureCache
from epdserve.transfer.mm_store.connection import CONNECTION_ERRORS, StoreUnavailableError
from epdserve.transfer.mm_store.events import FeatureEvent, stream_name
from epdserve.transfer.mm_store.stats import Counters, feature_counters
from epdserve.transfer.mm_store.store import RedisMMStore

logger = logging.getLogger(__name__)


class PrefetchListener:
    def __init__(
        self,
        store: RedisMMStore,
        target: str,
        cache: LocalFeatureCache,
        counters: Counters | None = None,
        *,
        block_ms: int = 100,
        batch: int = 32,
        replay_s: float = 30.0,
        prefix: str = "epd:mm",
    ):
        if block_ms <= 0 or batch <= 0 or replay_s < 0:
            raise ValueError("block_ms and batch must be positive, replay_s >= 0")
        self.store = store
        self.stream = stream_name(target, prefix)
        self.cache = cache
        self.counters = counters if counters is not None else feature_counters()
        self.block_ms = block_ms
        self.batch = batch
        self.replay_s = replay_s
        self.last_id: str | None = None
        self._health = store.connection.health
        self._client = None  # made in the thread, where connection errors are handled
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def start(self) -> "PrefetchListener":
        if self._thread is not None:
            raise RuntimeError("listener already started")
        self._thread = threading.Thread(target=self._run, name=f"prefetch[{self.stream}]", daemon=True)
        self._thread.start()
        return self

    def stop(self, timeout_s: float = 5.0) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout_s)
            self._thread = None
        if self._client is not None:
            self._client.close()
            self._client = None

    def __enter__(self) -> "PrefetchListener":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()

    def _run(self) -> None:
        while not self._stop.is_set():
            if not self._health.allow():
                # Re-check at least every block_ms: cheap (no network), and stop() stays prompt.
                self._stop.wait(min(self._health.retry_in(), self.block_ms / 1000))
                continue
            try:
                if self._client is None:
                    self._client = self.store.connection.blocking_client(self.block_ms / 1000)
                if self.last_id is None:
                    self.last_id = self._start_id()
                reply = topology.read_stream(self._client, self.stream, self.last_id, self.batch, self.block_ms)
            except CONNECTION_ERRORS as e:
                self._health.record_failure(e)
                continue
            except redis.RedisError:  # e.g. a wrong-type key: not an outage, but do not spin
                logger.exception("prefetch listener on %s: read failed", self.stream)
                self._stop.wait(1.0)
                continue
            self._health.record_success()
            if reply:
                self._handle(reply[0][1])

    def _start_id(self) -> str:
        # The server's clock names stream ids, so ask it (the stream's node), not ours.
        ms = topology.server_time_ms(self._client, self.stream) - int(self.replay_s * 1000) - 1
        return f"{max(ms, 0)}-0"

    def _handle(self, entries: list) -> None:
        keys = []
        for entry_id, fields in entries:
            self.last_id = entry_id.decode() if isinstance(entry_id, bytes) else entry_id
            try:
                keys.append(FeatureEvent.from_fields(fields).key)
            except ValueError as e:
                logger.debug("ignoring %s", e)
        self.counters.add("events", len(keys))
        todo = self.cache.mark_inflight(dict.fromkeys(keys))
        if not todo:
            return
        try:
            features = self.store.get_many(todo, skip_corrupt=True)
        except StoreUnavailableError:
            self.cache.abandon(todo)
            return
        except Exception:
            self.cache.abandon(todo)
            logger.exception("prefetch of %d features failed", len(todo))
            return
        missing = []
        for key, feature in zip(todo, features):
            if feature is None:
                missing.append(key)
                continue
            self.cache.put(key, feature)
            self.counters.add("prefetches")
            self.counters.add("bytes_fetched", tensors_nbytes(feature))
        self.cache.abandon(missing)
