"""`PairNetwork`: how this process reaches its P–D pairs — the pair store and the data sockets.

The prefill side (rank 0) uses its own `PairStoreHost` in process; the decode side (rank 1)
reaches the prefill instance's through that instance's `KvStore` RPC (`PairRendezvous.host:port`
is its gRPC address), with the cluster token and, under mutual TLS, its certificate. `host` is
the interface the pair's gloo sockets bind (`Platform.make_pair_group(host=...)`): the instance's
advertised address, so a loopback deployment's pairs listen on loopback only. Without a
`PairNetwork` (tests, tools) a pair dials the store over plaintext gRPC and gloo picks its device
as torch does (the hostname's address, or GLOO_SOCKET_IFNAME).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from datetime import timedelta

import grpc

from epdserve.transfer.kv.messages import SENDER_RANK, PairRendezvous
from epdserve.transfer.kv.pair_store import PairStoreHost
from epdserve.transfer.kv.store_client import PairStoreClient
from epdserve.transfer.kv.store_view import PairStore


@dataclass(frozen=True, eq=False)
class PairNetwork:
    """host: the interface pair sockets bind (None: the backend's default); store: this process's
    own pair store (prefill side), None elsewhere; credentials: TLS credentials to dial a prefill
    instance (None: plaintext); metadata: (key, value) pairs sent on every store call."""

    host: str | None = None
    store: PairStoreHost | None = None
    credentials: grpc.ChannelCredentials | None = field(default=None, repr=False)
    metadata: tuple[tuple[str, str], ...] = field(default=(), repr=False)  # holds the token: never printed
    tls: tuple[str, str, str] | None = None  # (ca, cert, key) files the credentials came from

    def for_other_rank(self) -> dict:
        """What another rank of this instance (its own process) rebuilds this network from
        (`from_rank_parts`): no store — it dials the prefill instance's, as a decode side does —,
        the same host, token and certificate files. Travels over the rank's private socket only."""
        return {"host": self.host, "metadata": self.metadata, "tls": self.tls}

    @classmethod
    def from_rank_parts(cls, parts: dict) -> PairNetwork:
        from epdserve.security.tls import channel_credentials

        tls = parts["tls"]
        creds = channel_credentials(*tls) if tls else None
        return cls(host=parts["host"], credentials=creds, metadata=tuple(parts["metadata"]), tls=tls)

    def open_store(self, rdzv: PairRendezvous, timeout: timedelta) -> PairStore:
        """The pair's store as this side uses it (the caller ends it with the pair)."""
        if rdzv.rank == SENDER_RANK and self.store is not None:
            return PairStore(self.store, rdzv.pair_name, timeout, owner=True)
        client = PairStoreClient(f"{rdzv.host}:{rdzv.port}", self.credentials, list(self.metadata))
        return PairStore(client, rdzv.pair_name, timeout, owner=True)

    @classmethod
    def for_instance(cls, host: str, security, store: PairStoreHost | None) -> PairNetwork:
        """An instance's: bound to its advertised `host`, presenting what its `InstanceSecurity`
        holds (the cluster token; its certificate under mutual TLS)."""
        from epdserve.security.interceptors import cluster_metadata
        from epdserve.security.tls import channel_credentials

        sec = security
        creds = channel_credentials(sec.tls_ca, sec.tls_cert, sec.tls_key) if sec.mutual_tls else None
        return cls(host=host, store=store, credentials=creds, metadata=tuple(cluster_metadata(security.cluster_token)),
                   tls=(sec.tls_ca, sec.tls_cert, sec.tls_key) if sec.mutual_tls else None)
