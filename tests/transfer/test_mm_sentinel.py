"""The MM Store behind Sentinel (one primary, one replica, one sentinel; real redis-server
processes, password-protected): a `redis+sentinel://` URL finds the primary, and after the
primary is killed and the replica promoted the store answers again from the new primary, with
what was replicated before the kill."""
import time

import pytest
import torch

from epdserve.transfer.mm_store import RedisConnection, RedisMMStore, StoreUnavailableError
from tests.tools import require_tool
from tests.transfer.redis_topologies import RedisSentinelProcesses

require_tool("redis-server", "redis-cli", why="Debian's redis-server package", module=True)


@pytest.mark.timeout(120)
def test_store_follows_a_sentinel_failover():
    feature = [torch.randn(32, 16).bfloat16()]
    with RedisSentinelProcesses() as topo:
        conn = RedisConnection(topo.url(), backoff_s=0.1, max_backoff_s=0.5)
        store = RedisMMStore(topo.url(), ttl_s=600, connection=conn)
        try:
            assert conn.kind == "sentinel"
            store.put("ns:before", feature)
            assert conn.call(lambda c: c.wait(1, 10000)) == 1  # the replica has it
            topo.kill_primary()
            got, tries, deadline = None, 0, time.monotonic() + 60
            while got is None and time.monotonic() < deadline:
                tries += 1
                try:
                    got = store.get("ns:before")  # fails while the old primary is gone, then backs off
                except StoreUnavailableError:
                    time.sleep(0.05)
            assert got is not None and torch.equal(got[0], feature[0])
            store.put("ns:after", feature)  # writes go to the promoted replica
            assert torch.equal(store.get("ns:after")[0], feature[0])
            # a failover the calls saw is an outage counted; redis-py's sentinel pool may also reach
            # the promoted replica before any call fails (the first get succeeds: nothing to count)
            assert store.stats()["outages"] >= (1 if tries > 1 else 0)
        finally:
            store.close()
