"""Thread-safe counters of the MM Store path (store client, local cache, fetcher, listener).

The E side, the P engine thread and the prefetch listener thread all bump the same counters, so
every update takes a lock; `snapshot()` returns a plain dict, which `MMStoreFeatureProvider`
turns into the seam's `FeatureStats`. Recomputes are not counted here: the engine that re-runs
its vision encoder counts them (`EncodeStage.recomputes`, reported by `load_report()`).
"""
from __future__ import annotations

import threading
from collections.abc import Iterable


class Counters:
    """A fixed set of named integer counters."""

    def __init__(self, names: Iterable[str]):
        self._values = dict.fromkeys(names, 0)
        self._lock = threading.Lock()

    def add(self, name: str, n: int = 1) -> None:
        with self._lock:
            if name not in self._values:
                raise KeyError(f"unknown counter {name!r}; known: {sorted(self._values)}")
            self._values[name] += n

    def __getitem__(self, name: str) -> int:
        with self._lock:
            return self._values[name]

    def snapshot(self) -> dict[str, int]:
        with self._lock:
            return dict(self._values)


FEATURE_COUNTERS = (
    "hits_local",  # served from the P-side local cache
    "hits_store",  # fetched from the store by the request path (not prefetched)
    "misses",  # neither local nor in the store in time: the caller recomputes
    "waits",  # the request path waited for an in-flight prefetch
    "prefetches",  # features the listener moved into the local cache ahead of the request
    "events",  # feature events the listener received
    "bytes_fetched",  # payload bytes moved store -> P (request path and prefetch)
    "saves",  # features written to the store (encode side, or a prefill side's write-back)
    "save_failures",  # writes skipped: server down or refusing (prefill will recompute)
    "events_published",  # feature events sent to a prefill instance
    "bytes_stored",  # payload bytes moved E -> store
)


def feature_counters() -> Counters:
    """The counters one P-side fetcher and its listener share."""
    return Counters(FEATURE_COUNTERS)
