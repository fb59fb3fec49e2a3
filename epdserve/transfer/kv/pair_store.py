"""`PairStoreHost`: the in-process key-value store a prefill instance keeps for its P–D pairs.

It replaces a listening TCP store: nothing here opens a socket. The prefill side uses it
directly (`LocalPairStore`); decode peers reach it through the `KvStore` RPC of the prefill
instance's own gRPC port (`GrpcPairStore`), which requires the cluster token and mutual TLS
where the deployment has them. What travels through it: the backend's rendezvous (gloo's
addresses, NCCL's unique id, HCCL's root info) and one batch header per KV batch.

Each pair has its own namespace (its pair name), dropped by `release` when the pair ends.
Bounded, so a caller cannot exhaust memory: at most `max_pairs` namespaces (the least recently
used is dropped for a new one: an idle pair has nothing left to read in it), `max_keys` keys per
pair, `max_value_bytes` per value and `max_total_bytes` in all; a write beyond them raises
`StoreFull` and stores nothing. Waits (`get`, `wait`, `take`) block on a condition, at most
`MAX_WAIT_S` per call (an RPC's caller repeats until its own deadline).
"""
from __future__ import annotations

import threading
import time
from collections import OrderedDict

MAX_WAIT_S = 1.0  # the longest one call waits for a key (a decode peer's RPC holds a server thread meanwhile)


class StoreFull(RuntimeError):
    """A write would pass one of the store's bounds; nothing was stored."""


class PairStoreHost:
    def __init__(self, max_pairs: int = 4096, max_keys: int = 1024, max_value_bytes: int = 4 << 20,
                 max_total_bytes: int = 256 << 20):
        self.max_pairs, self.max_keys = max_pairs, max_keys
        self.max_value_bytes, self.max_total_bytes = max_value_bytes, max_total_bytes
        self._pairs: OrderedDict[str, dict[str, bytes]] = OrderedDict()  # least recently used first
        self._bytes = 0
        self._changed = threading.Condition()

    # ------------------------------------------------------------------ namespaces
    def _pair(self, pair: str, create: bool) -> dict[str, bytes] | None:
        """The pair's keys (most recently used from now on); created (evicting the least recently
        used pair when full) if `create`. Called with the condition held."""
        if not isinstance(pair, str) or not pair:
            raise ValueError("a pair store call needs the pair's name")
        keys = self._pairs.get(pair)
        if keys is not None:
            self._pairs.move_to_end(pair)
        elif create:
            if len(self._pairs) >= self.max_pairs:
                _, old = self._pairs.popitem(last=False)
                self._bytes -= sum(len(k) + len(v) for k, v in old.items())
            keys = self._pairs[pair] = {}
        return keys

    def release(self, pair: str) -> bool:
        """Drop the pair's namespace (its pair ended); True if it existed."""
        with self._changed:
            keys = self._pairs.pop(pair, None)
            if keys is not None:
                self._bytes -= sum(len(k) + len(v) for k, v in keys.items())
            return keys is not None

    def clear(self) -> None:
        with self._changed:
            self._pairs.clear()
            self._bytes = 0

    @property
    def num_pairs(self) -> int:
        return len(self._pairs)

    @property
    def total_bytes(self) -> int:
        return self._bytes

    # ------------------------------------------------------------------ writes
    def _put(self, pair: str, key: str, value: bytes) -> None:
        """Store key=value in the pair, within the bounds (condition held)."""
        if len(value) > self.max_value_bytes:
            raise StoreFull(f"pair store: a value of {len(value)} bytes exceeds {self.max_value_bytes}")
        keys = self._pair(pair, create=True)
        old = keys.get(key)
        if old is None and len(keys) >= self.max_keys:
            raise StoreFull(f"pair store: pair {pair!r} already holds {self.max_keys} keys")
        grow = len(value) - (len(old) if old is not None else -len(key))
        if self._bytes + grow > self.max_total_bytes:
            raise StoreFull(f"pair store: {self.max_total_bytes} bytes in use")
        keys[key] = bytes(value)
        self._bytes += grow
        self._changed.notify_all()

    def set(self, pair: str, key: str, value: bytes) -> None:
        with self._changed:
            self._put(pair, key, value)

    def add(self, pair: str, key: str, amount: int) -> int:
        """Add to the integer at key (0 if absent; stored as decimal text, as c10d stores do)."""
        with self._changed:
            keys = self._pair(pair, create=True)
            try:
                value = int(keys.get(key, b"0")) + int(amount)
            except ValueError:
                raise ValueError(f"pair store: key {key!r} does not hold an integer") from None
            self._put(pair, key, str(value).encode())
            return value

    def compare_set(self, pair: str, key: str, expected: bytes, desired: bytes) -> bytes:
        """c10d's compareSet: set `desired` if the key holds `expected` (or is absent and
        `expected` is empty); returns the value now held (or `expected` when absent)."""
        with self._changed:
            keys = self._pair(pair, create=True)
            current = keys.get(key)
            if current is None:
                if expected:
                    return bytes(expected)
                self._put(pair, key, desired)
                return bytes(desired)
            if current == expected:
                self._put(pair, key, desired)
                return bytes(desired)
            return current

    def delete(self, pair: str, key: str) -> bool:
        with self._changed:
            keys = self._pair(pair, create=False)
            if keys is None or key not in keys:
                return False
            self._bytes -= len(key) + len(keys.pop(key))
            return True

    # ------------------------------------------------------------------ reads
    def check(self, pair: str, keys: list[str]) -> bool:
        with self._changed:
            held = self._pair(pair, create=False) or {}
            return all(k in held for k in keys)

    def num_keys(self, pair: str) -> int:
        with self._changed:
            return len(self._pair(pair, create=False) or {})

    def wait(self, pair: str, keys: list[str], wait_s: float) -> bool:
        """True once every key is in the pair, False after `wait_s` (at most `MAX_WAIT_S`)."""
        with self._changed:
            return self._wait_for(pair, keys, wait_s) is not None

    def get(self, pair: str, key: str, wait_s: float = 0.0) -> bytes | None:
        """The key's value, waiting up to `wait_s` for it; None if it is still absent."""
        with self._changed:
            held = self._wait_for(pair, [key], wait_s)
            return None if held is None else held[key]

    def take(self, pair: str, key: str, wait_s: float = 0.0) -> bytes | None:
        """`get` and delete in one step (a batch header is read once)."""
        with self._changed:
            held = self._wait_for(pair, [key], wait_s)
            if held is None:
                return None
            value = held.pop(key)
            self._bytes -= len(key) + len(value)
            return value

    def _wait_for(self, pair: str, keys: list[str], wait_s: float) -> dict[str, bytes] | None:
        """The pair's keys once all of `keys` are there, else None after the wait (condition held)."""
        deadline = time.monotonic() + max(0.0, min(float(wait_s), MAX_WAIT_S))
        while True:
            held = self._pair(pair, create=False)
            if held is not None and all(k in held for k in keys):
                return held
            left = deadline - time.monotonic()
            if left <= 0:
                return None
            self._changed.wait(left)
