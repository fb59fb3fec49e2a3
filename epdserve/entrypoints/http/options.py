"""`HttpOptions`: what the operator sets for the HTTP front (validated on construction)."""
from __future__ import annotations

from dataclasses import dataclass

from epdserve.entrypoints.http.media_address import MediaDomains


@dataclass
class HttpOptions:
    """host/port: where the front binds (port 0 picks a free one). api_key: when set, every
    /v1 route needs ``Authorization: Bearer <key>`` (401 otherwise). allow_remote_images: fetch
    ``http(s)://`` image URLs (off: only ``data:`` URLs), each at most `max_image_bytes` and
    `image_fetch_timeout_s` (the whole fetch, redirects included); allowed_media_domains: the
    only hosts remote images may come from, which may then be internal (empty: any host whose
    addresses are all global; `media_address.MediaDomains`; a string is read comma-separated).
    max_body_bytes: a bigger request body is refused with 413.
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

    def __repr__(self) -> str:  # never print the key
        return (f"HttpOptions(host={self.host!r}, port={self.port}, api_key={'***' if self.api_key else None}, "
                f"allow_remote_images={self.allow_remote_images}, "
                f"allowed_media_domains={','.join(self.allowed_media_domains) or None}, tls={bool(self.tls_cert)})")
