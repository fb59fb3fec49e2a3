"""Feature events E -> P: "the features of <key> for <request_id> are in the store".

Transport: one Redis Stream per prefill instance (``<prefix>:events:<target>``), written with
XADD (MAXLEN ~ bounded, stream expires when idle) and read with XREAD BLOCK by that instance's
`PrefetchListener`.

Why Streams and not pub/sub: pub/sub is fire-and-forget, so an event published while the
listener is not subscribed (its process restarting, its connection re-establishing after a
network blip) is simply gone. A Stream keeps its last ``maxlen`` events and a reader names the
id it continues after: a listener that reconnects resumes from the last id it processed, and a
freshly started listener begins ``replay_s`` seconds in the past (stream ids are the server's
millisecond clock), so events sent while it restarted are replayed, not lost. No consumer
groups: each stream has exactly one reader and a lost prefetch is harmless (prefill reads the
store itself or recomputes), so XREADGROUP/XACK bookkeeping would buy nothing. If the server
itself restarts, the stream is gone, but so are the features it pointed to.

Only keys and request ids travel here; feature bytes travel once, through the store.
"""
from __future__ import annotations

from dataclasses import dataclass

from epdserve.transfer.mm_store.connection import RedisConnection


@dataclass(frozen=True)
class FeatureEvent:
    key: str
    request_id: str

    def to_fields(self) -> dict[str, str]:
        return {"key": self.key, "rid": self.request_id}

    @classmethod
    def from_fields(cls, fields: dict[bytes, bytes]) -> "FeatureEvent":
        try:
            return cls(key=fields[b"key"].decode(), request_id=fields[b"rid"].decode())
        except (KeyError, UnicodeDecodeError) as e:
            raise ValueError(f"malformed feature event {fields!r}: {e}") from None


def stream_name(target: str, prefix: str = "epd:mm") -> str:
    """The event stream of one prefill instance (``target`` is its instance id)."""
    if not target or not isinstance(target, str):
        raise ValueError(f"an event target is a non-empty instance id, got {target!r}")
    return f"{prefix}:events:{target}"


class EventPublisher:
    """E side: announce stored features to a prefill instance. Publish only after the put."""

    def __init__(self, connection: RedisConnection, *, prefix: str = "epd:mm", maxlen: int = 10_000,
                 idle_expire_s: int = 3600):
        if maxlen <= 0 or idle_expire_s <= 0:
            raise ValueError("maxlen and idle_expire_s must be positive")
        self.connection = connection
        self.prefix = prefix
        self.maxlen = maxlen
        self.idle_expire_s = idle_expire_s

    def publish(self, target: str, event: FeatureEvent) -> None:
        """Raises `StoreUnavailableError` when the server is down (the event is then moot too)."""
        stream = stream_name(target, self.prefix)

        def run(c):
            pipe = c.pipeline(transaction=False)
            pipe.xadd(stream, event.to_fields(), maxlen=self.maxlen, approximate=True)
            pipe.expire(stream, self.idle_expire_s)
            return pipe.execute()

        self.connection.call(run)
