"""The KV pair store: `PairStoreHost` (the prefill side's, in process), reached by decode peers
through the `KvStore` RPC of a real gRPC server that requires a cluster token. A caller without
the token is refused and its writes never land; the store's bounds hold; a real gloo pair (and a
batch) goes over it, its sockets on the interface `PairNetwork.host` names."""
from __future__ import annotations

from datetime import timedelta

import grpc
import psutil
import pytest
import torch
from torch.distributed import DistStoreError

from epdserve.engine.kv_cache import KVCacheSpec, PagedKVCache
from epdserve.platform import get_platform
from epdserve.rpc import instance_pb2, instance_pb2_grpc
from epdserve.security import Secret
from epdserve.security.interceptors import cluster_metadata
from epdserve.transfer.kv import (
    KVReceiver, KVSender, KVTransferConfig, PairNetwork, PairStoreHost, RecvRequest, RendezvousServer, SendRequest,
    StoreFull, TransferState,
)
from epdserve.transfer.kv.checks import blocks_digest, fill_random
from epdserve.transfer.kv.store_client import PairStoreClient
from epdserve.transfer.kv.store_view import PairStore

TOKEN = "kv-store-test-token"
Op = instance_pb2.KvStoreRequest


@pytest.fixture
def server():
    s = RendezvousServer(cluster_token=Secret(TOKEN))
    yield s
    s.close()


def _client(server, token: str | None = TOKEN) -> PairStoreClient:
    return PairStoreClient(f"{server.host}:{server.port}",
                           metadata=cluster_metadata(Secret(token)) if token is not None else None)


def test_host_semantics_as_c10d_stores_have_them():
    s = PairStoreHost()
    s.set("p", "k", b"v")
    assert s.get("p", "k") == b"v" and s.get("q", "k") is None  # pairs are separate namespaces
    assert s.add("p", "n", 2) == 2 and s.add("p", "n", 3) == 5 and s.get("p", "n") == b"5"
    assert s.compare_set("p", "c", b"", b"first") == b"first"  # absent + expected empty: set
    assert s.compare_set("p", "c", b"other", b"x") == b"first"  # mismatch: unchanged
    assert s.compare_set("p", "c", b"first", b"second") == b"second"
    assert s.compare_set("p", "absent", b"e", b"d") == b"e" and not s.check("p", ["absent"])
    assert s.check("p", ["k", "n"]) and not s.check("p", ["k", "nope"])
    assert s.take("p", "k") == b"v" and s.get("p", "k") is None
    assert s.delete("p", "n") and not s.delete("p", "n")
    assert s.num_keys("p") == 1 and s.release("p") and s.num_pairs == 0 and s.total_bytes == 0


def test_host_bounds_refuse_and_store_nothing():
    s = PairStoreHost(max_pairs=2, max_keys=2, max_value_bytes=8, max_total_bytes=20)
    with pytest.raises(StoreFull, match="exceeds 8"):
        s.set("p", "big", b"x" * 9)
    s.set("p", "a", b"1")
    s.set("p", "b", b"2")
    with pytest.raises(StoreFull, match="2 keys"):
        s.set("p", "c", b"3")
    assert s.num_keys("p") == 2 and not s.check("p", ["c"])
    s.set("p", "a", b"11")  # replacing a key is not a new key
    s.set("q", "a", b"12345678")
    with pytest.raises(StoreFull, match="20 bytes"):
        s.set("q", "b", b"12345678")
    assert s.total_bytes == sum(len(k) + len(v) for k, v in (("a", b"11"), ("b", b"2"), ("a", b"12345678")))
    s.set("r", "a", b"1")  # a third pair: the least recently used one ("p") goes
    assert s.num_pairs == 2 and s.get("p", "a") is None and s.get("q", "a") == b"12345678"


def test_rpc_without_the_token_is_refused_and_its_write_never_lands(server):
    server.store.set("p0>d0/g0", "0/0", b"gloo address")
    address = f"{server.host}:{server.port}"
    with grpc.insecure_channel(address) as ch:
        stub = instance_pb2_grpc.InstanceStub(ch)
        for metadata in (None, [("epdserve-cluster-token", "wrong")]):
            for req in (Op(op=Op.KV_SET, pair_name="p0>d0/g0", keys=["batch-header/0"], value=b"{evil}"),
                        Op(op=Op.KV_SET, pair_name="p0>d0/g0", keys=["0/0"], value=b"attacker:1"),
                        Op(op=Op.KV_NUM_KEYS, pair_name="p0>d0/g0"),
                        Op(op=Op.KV_GET, pair_name="p0>d0/g0", keys=["0/0"]),
                        Op(op=Op.KV_RELEASE, pair_name="p0>d0/g0")):
                with pytest.raises(grpc.RpcError) as e:
                    stub.KvStore(req, metadata=metadata, timeout=10)
                assert e.value.code() == grpc.StatusCode.UNAUTHENTICATED
        for other in ("Prefill", "GetLoad"):  # the standalone server serves the store, nothing else
            with pytest.raises(grpc.RpcError) as e:
                getattr(stub, other)(getattr(instance_pb2, f"{other}Request")(),
                                     metadata=cluster_metadata(Secret(TOKEN)), timeout=10)
            assert e.value.code() == grpc.StatusCode.UNIMPLEMENTED
    assert server.store.get("p0>d0/g0", "0/0") == b"gloo address"
    assert not server.store.check("p0>d0/g0", ["batch-header/0"]) and server.store.num_keys("p0>d0/g0") == 1
    client = _client(server, token=None)
    with pytest.raises(DistStoreError, match="UNAUTHENTICATED"):
        client.set("p0>d0/g0", "batch-header/0", b"{}")
    client.close()


def test_rpc_with_the_token_reaches_the_store_within_its_bounds(server):
    client = _client(server)
    client.set("p", "k", b"value")
    assert server.store.get("p", "k") == b"value"
    assert client.get("p", "k") == b"value" and client.check("p", ["k"]) and client.num_keys("p") == 1
    assert client.add("p", "n", 4) == 4 and client.compare_set("p", "k", b"value", b"new") == b"new"
    assert client.take("p", "k") == b"new" and client.get("p", "k", wait_s=0.05) is None
    with pytest.raises(DistStoreError, match="RESOURCE_EXHAUSTED"):
        client.set("p", "huge", b"x" * (server.store.max_value_bytes + 1))
    assert not server.store.check("p", ["huge"])
    assert client.release("p") and server.store.num_pairs == 0
    client.close()


def test_store_view_waits_then_times_out(server):
    view = PairStore(_client(server), "p", timedelta(seconds=0.3), owner=True)
    with pytest.raises(DistStoreError, match="timed out after 0.3 s"):
        view.get("never")
    server.store.set("p", "later", b"x")
    view.wait(["later"])
    assert view.get("later") == b"x"
    assert view.take("later") == b"x" and view.take("later") is None  # read once (batch headers)
    view.end(release=True)
    assert server.store.num_pairs == 0


def _listening(proc: psutil.Process) -> set[tuple[str, int]]:
    return {(c.laddr.ip, c.laddr.port) for c in proc.net_connections("inet") if c.status == psutil.CONN_LISTEN}


def test_gloo_pair_over_the_rpc_store_binds_the_named_interface(server):
    """P in process, D over the token-checked RPC; both sides' gloo devices on 127.0.0.2 (a
    loopback address the hostname does not resolve to): the interface follows PairNetwork.host."""
    spec = KVCacheSpec(num_layers=3, num_kv_heads=2, head_dim=8, block_size=4, dtype=torch.bfloat16)
    cpu = get_platform("cpu")
    p_cfg = KVTransferConfig(timeout_s=5, connect_timeout_s=20, network=PairNetwork(host="127.0.0.2",
                                                                                    store=server.store))
    d_cfg = KVTransferConfig(timeout_s=5, connect_timeout_s=20, network=PairNetwork(
        host="127.0.0.2", metadata=tuple(cluster_metadata(Secret(TOKEN)))))
    p_cache, d_cache = PagedKVCache(spec, 16), PagedKVCache(spec, 16)
    tx, rx = KVSender(p_cache, cpu, p_cfg), KVReceiver(d_cache, cpu, d_cfg)
    me = psutil.Process()
    before = _listening(me)
    try:
        rdzv = server.rendezvous("p0>d0/g0")
        pairs = tx.connect("d0", rdzv), rx.connect("p0", rdzv.for_peer())
        assert all(p.wait_ready(30) for p in pairs), [p.error for p in pairs]
        opened = _listening(me) - before
        assert len(opened) == 2 and {ip for ip, _ in opened} == {"127.0.0.2"}  # one gloo listener per side
        rx.expect(RecvRequest("r0", "p0", (5, 6, 7), 10))
        tx.begin_batch([SendRequest("r0", "d0", (0, 1, 2), (5, 6, 7), 10)])
        for layer in range(spec.num_layers):
            fill_random(p_cache, layer, (0, 1, 2), seed=7)
            tx.save_layer(layer)
        done = {}
        while len(done) < 2:
            done.update({("tx", s.request_id): s for s in tx.pop_finished()})
            done.update({("rx", s.request_id): s for s in rx.pop_finished()})
        assert all(s.state is TransferState.DONE for s in done.values()), done
        assert blocks_digest(d_cache, (5, 6, 7)) == blocks_digest(p_cache, (0, 1, 2))
        assert server.store.num_keys("p0>d0/g0") == 2  # gloo's two addresses; the header was taken
    finally:
        tx.close()
        rx.close()
    assert server.store.num_pairs == 0  # the pair ended: its namespace went
