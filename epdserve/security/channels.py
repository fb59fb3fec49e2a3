"""Client channels to a (possibly secured) epdserve server: TLS when a CA is given (or `tls`),
and the API key / cluster token sent as metadata on every call. Used by `Client`, `AsyncClient`
and the launcher."""
from __future__ import annotations

import grpc

from epdserve.security.interceptors import (aio_metadata_interceptors, api_key_metadata, cluster_metadata,
                                            metadata_interceptors)
from epdserve.security.secrets import API_KEY_ENV, CLUSTER_TOKEN_ENV, Secret
from epdserve.security.tls import channel_credentials


def _pairs(api_key, cluster_token) -> list[tuple[str, str]]:
    key = Secret(api_key) if isinstance(api_key, str) else api_key
    token = Secret(cluster_token) if isinstance(cluster_token, str) else cluster_token
    return api_key_metadata(key) + cluster_metadata(token)


def from_env(api_key=None, cluster_token=None):
    """(api_key, cluster_token): the given ones, else EPDSERVE_API_KEY / EPDSERVE_CLUSTER_TOKEN."""
    return (api_key or Secret.load(env=API_KEY_ENV), cluster_token or Secret.load(env=CLUSTER_TOKEN_ENV))


def channel(address: str, options=None, *, api_key=None, cluster_token=None, tls_ca: str | None = None,
            tls: bool = False) -> grpc.Channel:
    if tls or tls_ca:
        ch = grpc.secure_channel(address, channel_credentials(tls_ca), options=options)
    else:
        ch = grpc.insecure_channel(address, options=options)
    return grpc.intercept_channel(ch, *metadata_interceptors(_pairs(api_key, cluster_token)))


def aio_channel(address: str, options=None, *, api_key=None, cluster_token=None, tls_ca: str | None = None,
                tls: bool = False) -> grpc.aio.Channel:
    interceptors = aio_metadata_interceptors(_pairs(api_key, cluster_token))
    if tls or tls_ca:
        return grpc.aio.secure_channel(address, channel_credentials(tls_ca), options=options,
                                       interceptors=interceptors)
    return grpc.aio.insecure_channel(address, options=options, interceptors=interceptors)
