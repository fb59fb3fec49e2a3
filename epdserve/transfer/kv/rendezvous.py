"""`RendezvousServer`: a pair store served on a gRPC port of its own, for processes that are not
instances (tests, the KV benchmark).

An instance never uses it: its `PairStoreHost` is served by its own Instance port (`KvStore`),
behind that port's cluster token and TLS. This one serves the same RPC (the Instance service,
every other method UNIMPLEMENTED) on `host` (loopback unless told), requiring `cluster_token`
when one is given. `network()` is the prefill side's `PairNetwork` (the store in process);
decode peers dial `rendezvous(...).for_peer()`.
"""
from __future__ import annotations

from concurrent import futures

import grpc

from epdserve.rpc import instance_pb2_grpc
from epdserve.transfer.kv.messages import SENDER_RANK, PairRendezvous
from epdserve.transfer.kv.network import PairNetwork
from epdserve.transfer.kv.pair_store import PairStoreHost
from epdserve.transfer.kv.store_service import serve_kv_store


class _StoreOnly(instance_pb2_grpc.InstanceServicer):
    def __init__(self, store: PairStoreHost):
        self.store = store

    def KvStore(self, request, context):
        return serve_kv_store(self.store, request, context)


class RendezvousServer:
    """host: the address it binds and peers reach it at; port 0 picks a free one (`.port`);
    cluster_token: a `Secret` every call must present (None: none required)."""

    def __init__(self, host: str = "127.0.0.1", port: int = 0, cluster_token=None, store: PairStoreHost | None = None):
        from epdserve.security.interceptors import AuthInterceptor
        from epdserve.security.options import InstanceSecurity

        self.host = host
        self.store = store or PairStoreHost()
        rules = InstanceSecurity(cluster_token).rules()
        self._server = grpc.server(futures.ThreadPoolExecutor(max_workers=16, thread_name_prefix="kv-store"),
                                   interceptors=[AuthInterceptor(rules)] if rules else None)
        instance_pb2_grpc.add_InstanceServicer_to_server(_StoreOnly(self.store), self._server)
        self.port = self._server.add_insecure_port(f"{host}:{port}")
        if not self.port:
            raise OSError(f"cannot bind {host}:{port}")
        self._server.start()

    def rendezvous(self, pair_name: str, rank: int = SENDER_RANK) -> PairRendezvous:
        return PairRendezvous(self.host, self.port, pair_name, rank)

    def network(self) -> PairNetwork:
        """The prefill side's: this store in process, pair sockets on `host`."""
        return PairNetwork(host=self.host, store=self.store)

    def close(self) -> None:
        if self._server is not None:
            self._server.stop(0.5).wait(2.0)
            self._server = None
        self.store.clear()
