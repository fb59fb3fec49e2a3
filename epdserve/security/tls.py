"""TLS credentials from PEM files: `server_credentials` for a gRPC port (optionally requiring
client certificates signed by `client_ca`: mutual TLS), `channel_credentials` for a client."""
from __future__ import annotations

from pathlib import Path

import grpc


def _read(path) -> bytes:
    return Path(path).read_bytes()


def server_credentials(cert: str, key: str, client_ca: str | None = None) -> grpc.ServerCredentials:
    return grpc.ssl_server_credentials([(_read(key), _read(cert))],
                                       root_certificates=_read(client_ca) if client_ca else None,
                                       require_client_auth=bool(client_ca))


def channel_credentials(ca: str | None = None, cert: str | None = None, key: str | None = None
                        ) -> grpc.ChannelCredentials:
    """`ca`: the roots to trust (None: the system's); `cert`/`key`: this side's, for mutual TLS."""
    return grpc.ssl_channel_credentials(root_certificates=_read(ca) if ca else None,
                                        private_key=_read(key) if key else None,
                                        certificate_chain=_read(cert) if cert else None)
