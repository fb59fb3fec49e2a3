"""Events -> PrefetchListener -> LocalFeatureCache -> FeatureFetcher, against a real server.

Order is established with the cache's condition variable and counters, never with sleeps.
"""
import threading
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
    RedisMMStore,
    feature_counters,
)


@pytest.fixture(scope="module")
def server():
    with LocalRedisServer() as srv:
        yield srv


@pytest.fixture
def parts(server):
    """One E side (store + publisher) and one P side (cache, counters, fetcher) on a fresh target."""
    store = RedisMMStore(server.url, ttl_s=600)
    cache = LocalFeatureCache(256 << 20)
    counters = feature_counters()
    target = f"p-{uuid.uuid4().hex[:8]}"
    yield store, EventPublisher(store.connection), target, cache, counters, FeatureFetcher(store, cache, counters)
    store.close()


def _feature(seed):
    return [torch.randn(256, 64, generator=torch.Generator().manual_seed(seed)).bfloat16()]


def _send(store, publisher, target, key, feature, rid="r0"):
    store.put(key, feature)
    publisher.publish(target, FeatureEvent(key, rid))


def test_event_prefetches_before_get(parts):
    store, publisher, target, cache, counters, fetcher = parts
    feature = _feature(0)
    with PrefetchListener(store, target, cache, counters):
        _send(store, publisher, target, "ns:a", feature)
        assert cache.wait_for("ns:a", timeout_s=30) is not None  # arrived through the event
        got = fetcher.get("ns:a", timeout_s=0)
    assert torch.equal(got[0], feature[0])
    snap = counters.snapshot()
    assert snap["events"] == 1 and snap["prefetches"] == 1
    assert snap["hits_local"] == 1 and snap["hits_store"] == 0 and snap["misses"] == 0
    assert snap["bytes_fetched"] == feature[0].numel() * 2


def test_events_sent_while_listener_restarts_are_replayed(parts):
    store, publisher, target, cache, counters, fetcher = parts
    with PrefetchListener(store, target, cache, counters):
        _send(store, publisher, target, "ns:first", _feature(1))
        assert cache.wait_for("ns:first", timeout_s=30) is not None
    _send(store, publisher, target, "ns:while-down", _feature(2))  # no listener running
    with PrefetchListener(store, target, cache, counters, replay_s=60):
        assert cache.wait_for("ns:while-down", timeout_s=30) is not None
    assert counters["prefetches"] == 2


def test_get_waits_for_a_feature_still_being_encoded(parts):
    store, publisher, target, cache, counters, fetcher = parts
    waiting = threading.Event()

    class SignallingCache(LocalFeatureCache):  # tells the test when get() starts waiting
        def wait_for(self, key, timeout_s, inflight_only=False):
            waiting.set()
            return super().wait_for(key, timeout_s, inflight_only)

    cache = SignallingCache(64 << 20)
    fetcher = FeatureFetcher(store, cache, counters)
    feature, result = _feature(3), []
    with PrefetchListener(store, target, cache, counters):
        getter = threading.Thread(target=lambda: result.append(fetcher.get("ns:late", timeout_s=60)))
        getter.start()
        assert waiting.wait(30)
        _send(store, publisher, target, "ns:late", feature)  # E finishes after P asked
        getter.join(60)
    assert torch.equal(result[0][0], feature[0])
    assert counters["hits_local"] == 1 and counters["misses"] == 0


def test_get_reads_the_store_when_no_event_came(parts):
    store, _, _, cache, counters, fetcher = parts
    store.put("ns:no-event", _feature(4))
    assert fetcher.get("ns:no-event") is not None
    assert fetcher.get("ns:no-event") is not None  # now local
    assert fetcher.get("ns:absent", timeout_s=0) is None
    snap = counters.snapshot()
    assert (snap["hits_store"], snap["hits_local"], snap["misses"]) == (1, 1, 1)


def test_duplicate_events_fetch_once(parts):
    store, publisher, target, cache, counters, fetcher = parts
    store.put("ns:dup", _feature(5))
    for rid in ("r1", "r2", "r3"):
        publisher.publish(target, FeatureEvent("ns:dup", rid))
    store.put("ns:marker", _feature(6))
    publisher.publish(target, FeatureEvent("ns:marker", "r4"))
    with PrefetchListener(store, target, cache, counters, replay_s=60):
        assert cache.wait_for("ns:marker", timeout_s=30) is not None  # events are read in order
    assert counters["events"] == 4 and counters["prefetches"] == 2


def test_in_flight_prefetch_is_waited_for_not_fetched_twice(parts):
    store, _, _, _, counters, _ = parts
    waiting = threading.Event()

    class SignallingCache(LocalFeatureCache):
        def wait_for(self, key, timeout_s, inflight_only=False):
            waiting.set()
            return super().wait_for(key, timeout_s, inflight_only)

    cache = SignallingCache(64 << 20)
    fetcher = FeatureFetcher(store, cache, counters, inflight_wait_s=60)
    assert cache.mark_inflight(["ns:inflight"]) == ["ns:inflight"]  # as the listener does
    feature, result = _feature(7), []
    getter = threading.Thread(target=lambda: result.append(fetcher.get("ns:inflight", timeout_s=0)))
    getter.start()
    assert waiting.wait(30)
    cache.put("ns:inflight", feature)  # the prefetch lands
    getter.join(60)
    assert torch.equal(result[0][0], feature[0])
    assert counters["waits"] == 1 and counters["hits_local"] == 1 and store.stats()["gets"] == 0
