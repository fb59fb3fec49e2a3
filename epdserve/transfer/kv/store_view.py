"""`PairStore`: one pair's namespace of a pair store, as a `torch.distributed.Store`.

The backend is a `PairStoreHost` (the prefill side, in process) or a `PairStoreClient` (the
decode side, over the prefill instance's `KvStore` RPC). Process groups take it as they take a
TCPStore: c10d's `PythonStore` trampoline forwards `set`, `get`, `add`, `compare_set`, `check`,
`wait`, `deleteKey`, `getNumKeys` and `clone` (C++ names where it uses them) to Python.
`get` and `wait` block until the keys are there, for at most the store's `timeout` (then
`DistStoreError`), in calls of at most `MAX_WAIT_S` each.

The Python object must outlive every C++ user (a process group keeps only the C++ half):
its owner (`PairConnection`) holds both and drops them together.
"""
from __future__ import annotations

import time
from datetime import timedelta

from torch.distributed import DistStoreError, Store

from epdserve.transfer.kv.pair_store import MAX_WAIT_S


def _bytes(value) -> bytes:
    return value.encode() if isinstance(value, str) else bytes(value)


class PairStore(Store):
    """owner: this side ends the pair's namespace and the backend (a client's channel) on `end()`."""

    def __init__(self, backend, pair: str, timeout: timedelta, owner: bool = False):
        super().__init__()
        self.backend, self.pair, self.owner = backend, pair, owner
        self.set_timeout(timeout)

    def _until(self, what: str, timeout: timedelta | None, step) -> object:
        """Repeat `step(wait_s)` until it returns something other than None, within `timeout`
        (the store's when None)."""
        limit = (timeout or self.timeout).total_seconds()
        deadline = time.monotonic() + limit
        while True:
            left = deadline - time.monotonic()
            out = step(min(max(left, 0.0), MAX_WAIT_S))
            if out is not None:
                return out
            if left <= 0:
                raise DistStoreError(f"KV pair {self.pair!r}: timed out after {limit:g} s waiting for {what}")

    # ------------------------------------------------------------------ torch.distributed.Store
    def set(self, key: str, value) -> None:
        self.backend.set(self.pair, key, _bytes(value))

    def get(self, key: str) -> bytes:
        return self._until(f"key {key!r}", None, lambda s: self.backend.get(self.pair, key, s))

    def add(self, key: str, amount: int) -> int:
        return self.backend.add(self.pair, key, int(amount))

    def compare_set(self, key: str, expected, desired) -> bytes:
        return self.backend.compare_set(self.pair, key, _bytes(expected), _bytes(desired))

    def check(self, keys: list[str]) -> bool:
        return self.backend.check(self.pair, list(keys))

    def wait(self, keys: list[str], timeout: timedelta | None = None) -> None:
        self._until(f"keys {list(keys)}", timeout, lambda s: self.backend.wait(self.pair, list(keys), s) or None)

    def delete_key(self, key: str) -> bool:
        return self.backend.delete(self.pair, key)

    deleteKey = delete_key  # the name c10d's trampoline calls

    def num_keys(self) -> int:
        return self.backend.num_keys(self.pair)

    getNumKeys = num_keys  # the name c10d's trampoline calls

    def clone(self) -> PairStore:
        return PairStore(self.backend, self.pair, self.timeout)

    # ------------------------------------------------------------------ ours
    def take(self, key: str, wait_s: float = 0.0) -> bytes | None:
        """The key's value, removed, waiting up to `wait_s` (at most `MAX_WAIT_S`); None if absent."""
        return self.backend.take(self.pair, key, wait_s)

    def end(self, release: bool) -> None:
        """The pair ended (owner only): drop its namespace if `release`, close a client's channel."""
        if not self.owner:
            return
        try:
            if release:
                self.backend.release(self.pair)
        except Exception:  # best effort: the prefill side drops it too, and the store is bounded
            pass
        close = getattr(self.backend, "close", None)
        if close is not None:
            close()
