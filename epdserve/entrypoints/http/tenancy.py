"""The caller's tenant on the HTTP front, and which credentials open /metrics.

`caller_tenant(request)`: the tenant the request's API key names (`security/tenants.py`), set by
the app's key check before any body is read; the default tenant (``""``) where no key is set.
Routes that keep per-caller state (request ids, uploaded files) scope it by this value; the gRPC
front's twin is `epdserve.scheduler.services.caller_tenant(context, tenant_of)`.
`http_keys(opts)`: the front's `TenantKeys` (the deployment's, or one from `opts.api_key`).
`metrics_matcher(opts)`: what /metrics accepts: the scrape token when one is set, else the
single API key; never a keys-file tenant's key (the metrics count every tenant's requests and
cache hits).
"""
from __future__ import annotations

from fastapi import Request

from epdserve.security.secrets import Secret
from epdserve.security.tenants import DEFAULT_TENANT, TenantKeys


def caller_tenant(request: Request) -> str:
    """The tenant of an HTTP caller whose key the app checked (the default tenant otherwise)."""
    return getattr(request.state, "tenant", DEFAULT_TENANT)


def http_keys(opts) -> TenantKeys | None:
    if opts.tenants is not None:
        return opts.tenants
    return TenantKeys(Secret(opts.api_key)) if opts.api_key else None


class _AnyOf:
    def __init__(self, secrets: list[Secret]):
        self.secrets = secrets

    def matches(self, presented: str | None) -> bool:
        return any([s.matches(presented) for s in self.secrets])  # every one compared: no early exit


def metrics_matcher(opts):
    """Who may read /metrics when it needs a credential: the scrape token, else the single API key."""
    if opts.metrics_token:
        return _AnyOf([Secret(opts.metrics_token)])
    if opts.api_key:
        return _AnyOf([Secret(opts.api_key)])
    return _AnyOf([])
