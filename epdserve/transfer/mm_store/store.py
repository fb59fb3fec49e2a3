"""The MM Store: hash-keyed media features (lists of tensors) in a key-value server.

`RedisMMStore` is the store, over one Redis-protocol server (redis://, rediss:// with TLS,
passwords in the URL; redis-py picks hiredis up by itself), shared by encode (writer) and
prefill (reader) instances.

Contract:
- keys are media keys (`epdserve.seams.media_keys.media_key`); a value is the list of tensors of one media item;
- `put` overwrites (the same key always means the same features) and sets the TTL;
- `get` returns None when the key is absent: never stored, expired, evicted or deleted;
- calls raise `StoreUnavailableError` when the server cannot be reached (fast: short timeouts,
  then a backoff during which calls fail without touching the network), and `get` raises
  `CorruptFeatureError` for an unreadable value (`skip_corrupt=True` deletes it and reads None);
- values in the server are namespaced by the codec's format version, so two epdserve versions
  sharing a server never read each other's layout;
- a value carries its key (codec): one read back under another key (entries swapped or copied
  in the server) is a `CorruptFeatureError` (`ForeignFeatureError`), handled like any corrupt value.
"""
from __future__ import annotations

import logging
from collections.abc import Sequence

import redis
import torch

from epdserve.transfer.mm_store import codec
from epdserve.transfer.mm_store.codec import CorruptFeatureError
from epdserve.transfer.mm_store.connection import RedisConnection, StoreUnavailableError
from epdserve.transfer.mm_store.stats import Counters

logger = logging.getLogger(__name__)

Feature = list[torch.Tensor]

__all__ = ["RedisMMStore", "MMStoreError", "StoreUnavailableError", "CorruptFeatureError"]


class MMStoreError(RuntimeError):
    """The server answered but refused the operation (e.g. out of memory with noeviction)."""


class RedisMMStore:
    """Hash-keyed feature storage over a Redis-protocol server. Thread-safe (redis-py's pool is)."""

    def __init__(
        self,
        url: str,
        ttl_s: float | None = 3600.0,
        *,
        key_prefix: str = "epd:mm",
        socket_timeout_s: float = 1.0,
        connect_timeout_s: float = 0.25,
        backoff_s: float = 0.5,
        max_backoff_s: float = 8.0,
        connection: RedisConnection | None = None,
    ):
        _check_ttl(ttl_s)
        self.ttl_s = ttl_s
        self.key_prefix = key_prefix
        self.connection = connection or RedisConnection(
            url,
            socket_timeout_s=socket_timeout_s,
            connect_timeout_s=connect_timeout_s,
            backoff_s=backoff_s,
            max_backoff_s=max_backoff_s,
        )
        self._value_prefix = f"{key_prefix}:v{codec.FORMAT_VERSION}:"
        self._counters = Counters(
            ("puts", "gets", "hits", "misses", "corrupt", "deletes", "bytes_written", "bytes_read")
        )

    def redis_key(self, key: str) -> str:
        if not isinstance(key, str) or not key:
            raise ValueError(f"a media key is a non-empty string, got {key!r}")
        return self._value_prefix + key

    def put(self, key: str, tensors: Sequence[torch.Tensor], ttl_s: float | None = None) -> int:
        """Store ``tensors`` under ``key``; returns the value's size in bytes."""
        ttl = self.ttl_s if ttl_s is None else ttl_s
        _check_ttl(ttl)
        value = codec.encode(tensors, key)
        px = int(ttl * 1000) if ttl else None
        rkey = self.redis_key(key)
        try:
            self.connection.call(lambda c: c.set(rkey, value, px=px))
        except redis.ResponseError as e:
            raise MMStoreError(f"MM Store refused to store {key} ({len(value)} bytes): {e}") from e
        self._counters.add("puts")
        self._counters.add("bytes_written", len(value))
        return len(value)

    def get_many(self, keys: Sequence[str], skip_corrupt: bool = False) -> list[Feature | None]:
        """One round trip for all ``keys``; None where a key is absent."""
        if not keys:
            return []
        rkeys = [self.redis_key(k) for k in keys]
        values = self.connection.call(lambda c: _pipelined(c, "get", rkeys))
        out: list[Feature | None] = []
        for key, value in zip(keys, values):
            self._counters.add("gets")
            if value is None:
                self._counters.add("misses")
                out.append(None)
                continue
            try:
                out.append(codec.decode(value, key))
            except CorruptFeatureError as e:
                if not skip_corrupt:
                    raise type(e)(f"MM Store value of {key}: {e}") from None  # ForeignFeatureError stays one
                self._drop_corrupt(key, e)
                out.append(None)
                continue
            self._counters.add("hits")
            self._counters.add("bytes_read", len(value))
        return out

    def get(self, key: str, skip_corrupt: bool = False) -> Feature | None:
        return self.get_many([key], skip_corrupt=skip_corrupt)[0]

    def exists_many(self, keys: Sequence[str]) -> list[bool]:
        """Whether each key is present now (it may still expire before it is read)."""
        if not keys:
            return []
        rkeys = [self.redis_key(k) for k in keys]
        return [bool(n) for n in self.connection.call(lambda c: _pipelined(c, "exists", rkeys))]

    def exists(self, key: str) -> bool:
        return self.exists_many([key])[0]

    def delete(self, key: str) -> bool:
        """Remove ``key``; True if it was there."""
        rkey = self.redis_key(key)
        self._counters.add("deletes")
        return bool(self.connection.call(lambda c: c.delete(rkey)))

    def stats(self) -> dict[str, int | float | bool]:
        """Client-side counters (no network round trip)."""
        return {**self._counters.snapshot(), "server_up": self.connection.health.up,
                "outages": self.connection.health.outages}

    def close(self) -> None:
        """Release connections."""
        self.connection.close()

    def _drop_corrupt(self, key: str, error: CorruptFeatureError) -> None:
        self._counters.add("corrupt")
        if self._counters["corrupt"] == 1:
            logger.warning("MM Store value of %s is unreadable (%s); deleted and recomputed. "
                           "Further ones are only counted in stats()['corrupt'].", key, error)
        try:
            self.delete(key)
        except StoreUnavailableError:
            pass


def _pipelined(client: redis.Redis, command: str, keys: list[str]) -> list:
    # A pipeline, not MGET: the server interleaves other clients between the GETs of big
    # values, and a cluster client can spread the keys over shards.
    if len(keys) == 1:
        return [getattr(client, command)(keys[0])]
    pipe = client.pipeline(transaction=False)
    for k in keys:
        getattr(pipe, command)(k)
    return pipe.execute()


def _check_ttl(ttl_s: float | None) -> None:
    if ttl_s is not None and (not isinstance(ttl_s, (int, float)) or ttl_s < 0):
        raise ValueError(f"ttl_s must be None or a number of seconds >= 0 (0: never expire), got {ttl_s!r}")
    if ttl_s and ttl_s < 0.001:
        raise ValueError(f"ttl_s must be at least 1 ms, got {ttl_s}")
