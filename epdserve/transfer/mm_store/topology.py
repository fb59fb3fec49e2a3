"""The redis-py client for one MM Store URL (urls.py), whatever the topology behind it.

- one server: `redis.Redis.from_url`;
- a Redis Cluster: `redis.cluster.RedisCluster` (redis-py's cluster client: it learns the
  slot map from CLUSTER SLOTS, routes each key, follows MOVED/ASK and splits a pipeline per
  node; nothing here computes a slot);
- Sentinel: `redis.sentinel.Sentinel(...).master_for(service)`: a `redis.Redis` whose pool asks
  the sentinels for the current primary on every new connection (after a failover the old
  connections fail once, the pool is dropped, and the next call reaches the promoted replica).

The MM Store's keys need no hash tags: every command touches one key (a feature's value is one
key that carries its own key and checksum, codec.py; an event stream is one key per prefill
instance, and its XADD and EXPIRE name the same key), and pipelines are non-transactional, which
redis-py's cluster pipeline splits per node. Without tags, features spread over every master.

Two calls need a node named on a cluster, both asked of redis-py (`get_node_from_key`): XREAD,
whose keys redis-py would otherwise find by asking the cluster's *default* node (COMMAND GETKEYS:
XREAD's keys are "movable"), so one dead master would stop every listener; and TIME, which must
come from the node that stamps the stream's ids.
"""
from __future__ import annotations

import os
from typing import Any

import redis
from redis.backoff import NoBackoff
from redis.cluster import ClusterNode, RedisCluster
from redis.connection import parse_url
from redis.retry import Retry
from redis.sentinel import Sentinel

from epdserve.transfer.mm_store.urls import CLUSTER, SENTINEL, SENTINEL_PASSWORD_ENV, StoreURL

# What "the topology cannot answer now" looks like, besides connection errors and timeouts
# (redis.ConnectionError covers Sentinel's MasterNotFoundError): a cluster with uncovered slots
# (CLUSTERDOWN, or no node for a slot), or no reachable node to learn the slot map from.
UNAVAILABLE_ERRORS = (redis.exceptions.ClusterDownError, redis.exceptions.RedisClusterException)


def make_client(url: StoreURL, *, socket_timeout_s: float, connect_timeout_s: float, auth: dict,
                extra: dict) -> redis.Redis | RedisCluster:
    """A client with short timeouts and no retries of its own (ServerHealth backs off).

    ``auth``: password / username from the environment (the URL's own win, as in redis-py);
    ``extra``: further redis.Redis keyword arguments (ignored by the cluster client)."""
    timeouts = dict(socket_timeout=socket_timeout_s, socket_connect_timeout=connect_timeout_s, health_check_interval=0)
    if url.kind == CLUSTER:
        # One retry: after a failover redis-py refreshes its slot map and sends the command to the
        # promoted replica, instead of reporting an outage. A cluster can only use database 0.
        return RedisCluster(url=url.node_url, startup_nodes=[ClusterNode(h, p) for h, p in url.members[1:]],
                            require_full_coverage=False, retry=Retry(NoBackoff(), 1), **auth, **timeouts)
    if url.kind == SENTINEL:
        node = {**auth, **timeouts, **extra, **parse_url(url.node_url)}  # the URL's options win, as with from_url
        node.pop("host", None)
        node.pop("port", None)
        if node.pop("connection_class", None) is not None or url.tls:  # rediss: SentinelManagedSSLConnection
            node["ssl"] = True
        tls = {k: v for k, v in node.items() if k.startswith("ssl")}
        sentinel_auth = dict(url.sentinel_auth)
        if "password" not in sentinel_auth and os.environ.get(SENTINEL_PASSWORD_ENV):
            sentinel_auth["password"] = os.environ[SENTINEL_PASSWORD_ENV]  # out of argv: launch puts it here
        sentinels = Sentinel(list(url.members), sentinel_kwargs={**timeouts, **tls, **sentinel_auth,
                                                                  "retry": Retry(NoBackoff(), 0)})
        return sentinels.master_for(url.service, retry=Retry(NoBackoff(), 0), **node)
    return redis.Redis.from_url(url.node_url, **auth, retry=Retry(NoBackoff(), 0), **timeouts, **extra)


def reset(client: redis.Redis | RedisCluster) -> None:
    """Drop every pooled connection (after an outage: no stale sockets once it is back)."""
    if isinstance(client, RedisCluster):
        client.disconnect_connection_pools()
    else:
        client.connection_pool.disconnect()


def on_node_of(client: redis.Redis | RedisCluster, key: str) -> dict[str, Any]:
    """Keyword arguments sending a command to the node that holds ``key`` ({} off a cluster)."""
    if isinstance(client, RedisCluster):
        return {"target_nodes": client.get_node_from_key(key)}
    return {}


def read_stream(client: redis.Redis | RedisCluster, stream: str, after_id: str, count: int, block_ms: int):
    """XREAD of one stream (blocking up to ``block_ms``), as redis-py's `xread` returns it."""
    if isinstance(client, RedisCluster):
        return client.execute_command("XREAD", "COUNT", count, "BLOCK", block_ms, "STREAMS", stream, after_id,
                                      **on_node_of(client, stream))
    return client.xread({stream: after_id}, count=count, block=block_ms)


def server_time_ms(client: redis.Redis | RedisCluster, key: str) -> int:
    """The clock (ms) of the server that holds ``key``: the one that names its stream ids."""
    sec, usec = client.time(**on_node_of(client, key))
    return sec * 1000 + usec // 1000
