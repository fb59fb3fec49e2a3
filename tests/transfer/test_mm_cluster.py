"""The MM Store on a 3-master Redis Cluster of real redis-server processes (password-protected):
puts and gets over every master, events and prefetch from streams on different masters, then a
master killed under load: reads become misses (recompute), nothing raises, nothing read is wrong.
Engines over the cluster: test_mm_cluster_engine.py."""
import threading
import time
import uuid

import pytest
import torch

from epdserve.transfer.mm_store import (
    EventPublisher,
    FeatureEvent,
    FeatureFetcher,
    LocalFeatureCache,
    PrefetchListener,
    RedisConnection,
    RedisMMStore,
    StoreUnavailableError,
    feature_counters,
)
from epdserve.transfer.mm_store.connection import PASSWORD_ENV
from tests.tools import require_tool
from tests.transfer.redis_topologies import RedisClusterProcesses

require_tool("redis-server", "redis-cli", why="Debian's redis-server package", module=True)


@pytest.fixture(scope="module")
def cluster():
    with RedisClusterProcesses(masters=3) as c:
        yield c


def _feature(seed, rows=64):
    return [torch.randn(rows, 32, generator=torch.Generator().manual_seed(seed)).bfloat16(),
            torch.arange(seed, seed + 3)]


def _same(a, b):
    return len(a) == len(b) and all(torch.equal(x, y) for x, y in zip(a, b))


def _masters(store):
    """{node name: number of keys}, asked of each master through redis-py's cluster client."""
    client = store.connection.client
    return {n.name: n.redis_connection.dbsize() for n in client.get_primaries()}


def test_puts_and_gets_spread_over_every_master(cluster, monkeypatch):
    monkeypatch.setenv(PASSWORD_ENV, cluster.password)  # the URL without its password, as `ps` shows it
    store = RedisMMStore(cluster.url(with_password=False), ttl_s=600, key_prefix=f"t{uuid.uuid4().hex[:6]}")
    try:
        assert store.connection.kind == "cluster"
        keys = [f"ns:img{i}" for i in range(30)]
        for i, k in enumerate(keys):
            store.put(k, _feature(i))
        got = store.get_many(keys + ["ns:absent"])  # one call, keys on every master
        assert all(_same(g, _feature(i)) for i, g in enumerate(got[:-1])) and got[-1] is None
        assert store.exists_many(["ns:img0", "ns:absent"]) == [True, False]
        assert store.delete("ns:img0") and store.get("ns:img0") is None
        counts = _masters(store)
        assert len(counts) == 3 and all(n > 0 for n in counts.values()), counts  # no hash tag piles keys up
    finally:
        store.close()


def test_events_prefetch_from_streams_on_several_masters(cluster):
    store = RedisMMStore(cluster.url(), ttl_s=600)
    publisher = EventPublisher(store.connection)
    client = store.connection.client
    targets = [f"p-{uuid.uuid4().hex[:8]}" for _ in range(6)]
    nodes = {client.get_node_from_key(f"epd:mm:events:{t}").name for t in targets}
    caches = {t: LocalFeatureCache(64 << 20) for t in targets}
    listeners = [PrefetchListener(store, t, caches[t], block_ms=50).start() for t in targets]
    try:
        for i, t in enumerate(targets):
            store.put(f"ns:ev{i}", _feature(100 + i))
            publisher.publish(t, FeatureEvent(f"ns:ev{i}", f"r{i}"))
        for i, t in enumerate(targets):
            got = caches[t].wait_for(f"ns:ev{i}", timeout_s=30)
            assert got is not None and _same(got, _feature(100 + i)), t
    finally:
        for listener in listeners:
            listener.stop()
        store.close()
    assert len(nodes) >= 2  # the streams themselves live on different masters


@pytest.mark.timeout(180)
def test_a_master_killed_under_load_only_turns_reads_into_misses():
    with RedisClusterProcesses(masters=3) as cluster:
        conn = RedisConnection(cluster.url(), backoff_s=0.1, max_backoff_s=0.4)
        store = RedisMMStore(cluster.url(), ttl_s=600, connection=conn)
        keys = [f"ns:load{i}" for i in range(48)]
        for i, k in enumerate(keys):
            store.put(k, _feature(i, rows=16))
        counters = feature_counters()
        fetcher = FeatureFetcher(store, LocalFeatureCache(1), counters)  # a 1-byte cache: every get asks the store
        killed = threading.Event()
        stop = threading.Event()
        wrong, errors, hits_after = [], [], [0]

        def reader(k):
            n = k
            while not stop.is_set():
                i = n % len(keys)
                try:
                    got = fetcher.get(keys[i])  # never raises: None means "recompute"
                    if got is not None:
                        if not _same(got, _feature(i, rows=16)):
                            wrong.append(i)
                        if killed.is_set():
                            hits_after[0] += 1
                    store.put(keys[i], _feature(i, rows=16))
                except StoreUnavailableError:
                    pass  # a put while the store backs off: the E side counts it and moves on
                except Exception as e:  # anything else is the bug
                    errors.append(repr(e))
                n += 4

        threads = [threading.Thread(target=reader, args=(k,), daemon=True) for k in range(4)]
        for t in threads:
            t.start()
        deadline = time.monotonic() + 60  # the readers hit the store under load before a master dies
        while counters["hits_store"] < 20 and not errors and time.monotonic() < deadline:
            time.sleep(0.05)
        assert counters["hits_store"] >= 20, (counters["hits_store"], errors)
        cluster.kill(0)
        killed.set()
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline and (hits_after[0] < 20 or counters["misses"] == 0):
            time.sleep(0.1)
        stop.set()
        for t in threads:
            t.join(10)
        store.close()
    assert not errors and not wrong
    assert counters["misses"] > 0  # reads on the dead master's slots were misses
    assert hits_after[0] >= 20  # the live masters kept serving theirs
    assert store.stats()["outages"] >= 1

