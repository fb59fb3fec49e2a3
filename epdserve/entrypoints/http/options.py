"""`HttpOptions`: what the operator sets for the HTTP front (validated on construction)."""
from __future__ import annotations

from dataclasses import dataclass

from epdserve.entrypoints.http.fence import parse_allowed_hosts
from epdserve.entrypoints.http.media_address import MediaDomains

PARSE_OFF_LOOP_BYTES = 256 * 1024  # a body this large is parsed in a worker thread


@dataclass
class HttpOptions:
    """host/port: where the front binds (port 0 picks a free one). api_key: when set, every
    /v1 route needs ``Authorization: Bearer <key>`` (401 otherwise). allow_remote_images: fetch
    ``http(s)://`` image URLs (off: only ``data:`` URLs), each at most `max_image_bytes` and
    `image_fetch_timeout_s` (the whole fetch, redirects included); allowed_media_domains: the
    only hosts remote images may come from, which may then be internal (empty: any host whose
    addresses are all global; `media_address.MediaDomains`; a string is read comma-separated).
    max_body_bytes: a bigger request body is refused with 413 (by its Content-Length, or as it
    streams in, before any parse; a body over `PARSE_OFF_LOOP_BYTES` is parsed in a worker thread,
    off the event loop gRPC shares). max_prompts_per_call: /v1/completions prompts in one call
    (400 beyond). tenants: the deployment's `TenantKeys` (`security/tenants.py`; shared with
    gRPC, reloaded on SIGHUP), which takes the place of `api_key`. allowed_hosts: Host names
    served beside loopback and the bound address (`fence`; a string is read comma-separated).
    metrics_token: the scrape token /metrics takes (with `metrics_auth`) instead of the API key.
    tls_cert/tls_key: serve HTTPS. served_model_name: the id /v1/models lists and requests may
    name (default: the scheduler's model path)."""

    host: str = "127.0.0.1"
    port: int = 0
    api_key: str | None = None
    allow_remote_images: bool = False
    image_fetch_timeout_s: float = 10.0
    max_image_bytes: int = 20 * 1024 * 1024
    allowed_media_domains: tuple[str, ...] = ()
    max_body_bytes: int = 64 * 1024 * 1024
    tls_cert: str | None = None
    tls_key: str | None = None
    served_model_name: str | None = None
    request_timeout_s: float | None = None  # a request still running after this is ended with 504
    max_prompts_per_call: int = 16
    tenants: object | None = None  # security.tenants.TenantKeys
    allowed_hosts: tuple[str, ...] = ()
    metrics_token: str | None = None

    def __post_init__(self):
        if not 0 <= int(self.port) < 65536:
            raise ValueError(f"http port must be 0..65535, got {self.port}")
        if self.image_fetch_timeout_s <= 0 or self.max_image_bytes < 1 or self.max_body_bytes < 1:
            raise ValueError("image_fetch_timeout_s, max_image_bytes and max_body_bytes must be > 0")
        if self.request_timeout_s is not None and self.request_timeout_s <= 0:
            raise ValueError("request_timeout_s must be > 0")
        domains = (MediaDomains.parse(self.allowed_media_domains) if isinstance(self.allowed_media_domains, str)
                   else MediaDomains(tuple(self.allowed_media_domains)))
        self.allowed_media_domains = domains.entries
        if bool(self.tls_cert) != bool(self.tls_key):
            raise ValueError("--tls-cert and --tls-key go together")
        if int(self.max_prompts_per_call) < 1:
            raise ValueError("max_prompts_per_call must be >= 1")
        self.allowed_hosts = parse_allowed_hosts(self.allowed_hosts)

    def __repr__(self) -> str:  # never print the key
        return (f"HttpOptions(host={self.host!r}, port={self.port}, api_key={'***' if self.api_key else None}, "
                f"tenants={self.tenants!r}, metrics_token={'***' if self.metrics_token else None}, "
                f"allow_remote_images={self.allow_remote_images}, "
                f"allowed_media_domains={','.join(self.allowed_media_domains) or None}, tls={bool(self.tls_cert)})")
