"""The server stops mid-run: gets return None at once, one warning in all, and use resumes
once it is back on the same port. A stepped clock drives the backoff: no sleeps."""
import logging
import uuid

import pytest
import torch

from epdserve.transfer.mm_store import (
    EventPublisher,
    FeatureEvent,
    FeatureFetcher,
    LocalFeatureCache,
    LocalRedisServer,
    PrefetchListener,
    RedisConnection,
    RedisMMStore,
    StoreUnavailableError,
    feature_counters,
)


class SteppedClock:
    def __init__(self):
        self.now = 1000.0

    def __call__(self):
        return self.now


@pytest.mark.timeout(120)  # a hang here would be the bug: requests must fall through quickly
def test_outage_falls_through_with_one_warning_and_recovers(caplog):
    caplog.set_level(logging.INFO, logger="epdserve.transfer.mm_store")
    clock = SteppedClock()
    with LocalRedisServer() as server:
        conn = RedisConnection(server.url, backoff_s=5.0, max_backoff_s=5.0, clock=clock)
        store = RedisMMStore(server.url, connection=conn)
        cache = LocalFeatureCache(64 << 20)
        counters = feature_counters()
        fetcher = FeatureFetcher(store, cache, counters)
        publisher = EventPublisher(conn)
        target = f"p-{uuid.uuid4().hex[:8]}"
        feature = [torch.randn(16, 8).bfloat16()]
        with PrefetchListener(store, target, cache, counters):
            store.put("ns:before", feature)
            publisher.publish(target, FeatureEvent("ns:before", "r0"))
            assert cache.wait_for("ns:before", 30) is not None

            server.stop()
            results = [fetcher.get(f"ns:req{i}", timeout_s=60) for i in range(20)]
            assert results == [None] * 20
            with pytest.raises(StoreUnavailableError):
                store.put("ns:x", feature)
            assert fetcher.get("ns:before") is not None  # the local cache still serves
            assert not store.stats()["server_up"]

            server.start()  # same port
            assert store.stats()["server_up"] is False  # still backing off: no network touched
            clock.now += 5.0  # backoff over: the listener (polling every block_ms) probes
            assert conn.health.wait_up(30)
            store.put("ns:after", feature)
            assert torch.equal(fetcher.get("ns:after")[0], feature[0])
            store.put("ns:after2", feature)
            publisher.publish(target, FeatureEvent("ns:after2", "r1"))  # the listener is back too
            assert cache.wait_for("ns:after2", 30) is not None
        store.close()

    records = [r for r in caplog.records if r.name.startswith("epdserve.transfer.mm_store")]
    warnings = [r for r in records if r.levelno == logging.WARNING]
    infos = [r for r in records if r.levelno == logging.INFO and "reachable again" in r.getMessage()]
    assert len(warnings) == 1 and "unreachable" in warnings[0].getMessage()
    assert len(infos) == 1
    assert counters["misses"] == 20 and store.stats()["outages"] == 1
