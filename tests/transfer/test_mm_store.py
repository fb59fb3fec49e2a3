"""RedisMMStore against a real Redis-protocol server."""
import uuid

import pytest
import redis
import torch

from epdserve.transfer.mm_store import CorruptFeatureError, LocalRedisServer, RedisMMStore
from epdserve.transfer.mm_store.codec import FORMAT_VERSION


@pytest.fixture(scope="module")
def server():
    with LocalRedisServer() as srv:
        yield srv


@pytest.fixture
def store(server):
    s = RedisMMStore(server.url, ttl_s=600)
    yield s
    s.close()


@pytest.fixture
def ns():
    return f"test-{uuid.uuid4().hex[:8]}"


def _bits(t):
    return t.reshape(-1).view(torch.uint8)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("n_tensors", [1, 3])
def test_round_trip_through_the_server_is_bit_exact(store, ns, dtype, n_tensors):
    tensors = [torch.randn(100 + i, 64).to(dtype) for i in range(n_tensors)]
    key = f"{ns}:img"
    size = store.put(key, tensors)
    assert size > sum(t.numel() * t.element_size() for t in tensors)
    got = store.get(key)
    assert [t.shape for t in got] == [t.shape for t in tensors]
    assert all(g.dtype == t.dtype and torch.equal(_bits(g), _bits(t)) for g, t in zip(got, tensors))


def test_get_many_exists_delete(store, ns):
    a, b = torch.randn(4, 8), torch.randn(2, 8).half()
    store.put(f"{ns}:a", [a])
    store.put(f"{ns}:b", [b])
    got = store.get_many([f"{ns}:a", f"{ns}:missing", f"{ns}:b"])
    assert torch.equal(got[0][0], a) and got[1] is None and torch.equal(got[2][0], b)
    assert store.exists_many([f"{ns}:a", f"{ns}:missing"]) == [True, False]
    assert store.delete(f"{ns}:a") and not store.delete(f"{ns}:a")
    assert store.get(f"{ns}:a") is None and not store.exists(f"{ns}:a")
    stats = store.stats()
    assert stats["hits"] == 2 and stats["misses"] == 2 and stats["server_up"]


def test_ttl_is_set_on_the_server(server, store, ns):
    raw = redis.Redis.from_url(server.url)
    store.put(f"{ns}:default", [torch.zeros(2)])
    store.put(f"{ns}:short", [torch.zeros(2)], ttl_s=5)
    store.put(f"{ns}:forever", [torch.zeros(2)], ttl_s=0)
    assert 590_000 < raw.pttl(store.redis_key(f"{ns}:default")) <= 600_000
    assert 0 < raw.pttl(store.redis_key(f"{ns}:short")) <= 5_000
    assert raw.pttl(store.redis_key(f"{ns}:forever")) == -1


def test_values_are_namespaced_by_format_version(store, ns):
    assert store.redis_key(f"{ns}:k") == f"epd:mm:v{FORMAT_VERSION}:{ns}:k"


def test_corrupt_value_raises_or_is_dropped(server, store, ns):
    key = f"{ns}:bad"
    store.put(key, [torch.randn(32)])
    raw = redis.Redis.from_url(server.url)
    raw.setrange(store.redis_key(key), 40, b"\xff\xff")
    with pytest.raises(CorruptFeatureError, match=key):
        store.get(key)
    raw.set(store.redis_key(key), b"truncated")
    assert store.get(key, skip_corrupt=True) is None
    assert not store.exists(key) and store.stats()["corrupt"] == 1


def test_memory_bound_evicts_old_features():
    with LocalRedisServer(maxmemory="24mb", maxmemory_policy="allkeys-lru") as srv:
        store = RedisMMStore(srv.url)
        value = [torch.zeros(1024, 3584, dtype=torch.bfloat16)]  # ~7 MB
        for i in range(8):
            store.put(f"k{i}", value)
        present = store.exists_many([f"k{i}" for i in range(8)])
        assert present[-1] and not present[0] and sum(present) <= 3
        store.close()


def test_password_url(ns):
    with LocalRedisServer(password="pw") as srv:
        store = RedisMMStore(srv.url)
        store.put(f"{ns}:k", [torch.ones(3)])
        assert torch.equal(store.get(f"{ns}:k")[0], torch.ones(3))
        store.close()


def test_bad_configuration_is_refused():
    with pytest.raises(ValueError, match="redis://, rediss://"):
        RedisMMStore("http://localhost:6379")
    with pytest.raises(ValueError, match="ttl_s"):
        RedisMMStore("redis://127.0.0.1:1", ttl_s=-1)
    with pytest.raises(ValueError, match="media key"):
        RedisMMStore("redis://127.0.0.1:1").get("")
