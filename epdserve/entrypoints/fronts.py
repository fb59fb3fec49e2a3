"""The scheduler's fronts beside its gRPC port: the OpenAI-compatible HTTP server (`--http-port`),
the Prometheus metrics (on the HTTP front's /metrics, or alone on `--metrics-port`), and the
security options of gRPC and HTTP alike (API key, cluster token, TLS, internal port, mutual TLS:
`epdserve.security`). `add_front_flags` / `add_security_flags` register the flags on
`epdserve scheduler`; `Fronts` starts them on the scheduler's running loop after the scheduler itself started, and
stops them before it stops. (This composition lives with the entrypoints: nothing in
`epdserve.scheduler` imports the HTTP front.)

The API key comes from --api-key, --api-key-file or the EPDSERVE_API_KEY environment variable
(the last two keep it out of argv, which other users of the machine can read); it is never logged.
Tenants' keys come from --api-keys-file ('<tenant> <key>' per line; `security/tenants.py`), which
the scheduler re-reads on SIGHUP. /metrics takes the scrape token (--metrics-token-file or
EPDSERVE_METRICS_TOKEN) and, without one, the single API key; with --metrics-auth auto it needs
one whenever a client key or a scrape token exists, or the port is beyond loopback.
"""
from __future__ import annotations

import logging
import os
from pathlib import Path

from epdserve.seams.media_keys import MEDIA_KEY_SECRET_ENV
from epdserve.security.exposure import INSECURE_HELP, guard, is_loopback
from epdserve.security.secrets import API_KEY_ENV, CLUSTER_TOKEN_ENV

METRICS_TOKEN_ENV = "EPDSERVE_METRICS_TOKEN"

log = logging.getLogger(__name__)


def add_front_flags(p) -> None:
    g = p.add_argument_group("HTTP front (OpenAI-compatible API)")
    g.add_argument("--http-port", type=int, default=None,
                   help="serve the OpenAI-compatible HTTP API on this port (0: a free one; default: no HTTP)")
    g.add_argument("--http-host", default=None, help="interface the HTTP front binds (default: --host)")
    g.add_argument("--served-model-name", default=None, help="model id /v1/models lists (default: --model)")
    g.add_argument("--allow-remote-images", action="store_true",
                   help="fetch http(s):// image URLs (default: only data: URLs), size- and time-limited; hosts "
                        "that resolve to a loopback, private, link-local, reserved or cloud-metadata address are "
                        "refused, and so is each of at most 3 redirects that leads to one")
    g.add_argument("--allowed-media-domains", default=None, metavar="HOST[,HOST...]",
                   help="with --allow-remote-images: fetch images only from these hosts, which may then be internal "
                        "addresses (never cloud metadata); an entry matches the URL's host exactly, '.example.com' "
                        "every name under example.com (default: any host whose addresses are all public)")
    g.add_argument("--image-fetch-timeout", type=float, default=10.0,
                   help="seconds for one remote image's whole fetch, redirects and body included")
    g.add_argument("--max-image-bytes", type=int, default=20 * 1024 * 1024, help="per image (default 20 MiB)")
    g.add_argument("--max-body-bytes", type=int, default=64 * 1024 * 1024,
                   help="larger HTTP request bodies are refused with 413 (default 64 MiB)")
    g.add_argument("--max-prompts-per-call", type=int, default=16,
                   help="prompts one /v1/completions call may carry (400 beyond; default 16)")
    g.add_argument("--allowed-hosts", default=None, metavar="HOST[,HOST...]",
                   help="Host header names the HTTP front answers besides localhost, loopback addresses and the "
                        "address it binds (a DNS-rebinding guard; '.example.com': every name under it; '*': any); "
                        "other Hosts get 400")
    g.add_argument("--http-request-timeout", type=float, default=None,
                   help="end an HTTP request still running after this many seconds with 504 (default: none)")
    g.add_argument("--http-address-file", type=Path, default=None, help="write the HTTP host:port here once serving")
    g.add_argument("--metrics-port", type=int, default=None,
                   help="serve Prometheus /metrics alone on this port (0: a free one), for gRPC-only deployments "
                        "(HTTPS with --tls-cert/--tls-key); with --http-port they are also on the HTTP front's /metrics")
    g.add_argument("--metrics-auth", choices=("auto", "on", "off"), default="auto",
                   help="/metrics needs the scrape token, or without one the single API key ('authorization: "
                        "Bearer TOKEN'; Prometheus: authorization.credentials_file): on, off, or auto (default) = "
                        "on whenever an API key, a keys file or a scrape token is set, or the port serving "
                        "/metrics is bound beyond loopback. Off beyond loopback is refused unless --insecure")
    g.add_argument("--metrics-token-file", type=Path, default=None,
                   help=f"file holding the scrape token /metrics takes (or set {METRICS_TOKEN_ENV}): give "
                        "Prometheus this, never a client API key")


def add_security_flags(p) -> None:
    g = p.add_argument_group("security")
    g.add_argument("--api-key", default=None,
                   help=f"API key clients must send (gRPC metadata / HTTP header 'authorization: Bearer <key>'); "
                        f"visible to other local users in argv: prefer {API_KEY_ENV} or --api-key-file")
    g.add_argument("--api-key-file", type=Path, default=None,
                   help=f"file holding the API key clients must send as 'Authorization: Bearer <key>' "
                        f"(or set {API_KEY_ENV}); default: no key")
    g.add_argument("--api-keys-file", type=Path, default=None,
                   help="file of tenants' API keys, one '<tenant> <key>' per line ('#' comments): each key names "
                        "its tenant, whose requests, request ids, media keys and cached prefixes no other tenant "
                        "sees; re-read on SIGHUP (a file that no longer parses keeps the keys in use); with "
                        "--api-key-file too, that key's holders are the default tenant")
    g.add_argument("--tls-cert", default=None,
                   help="PEM certificate: serve the public gRPC, HTTP and --metrics-port ports over TLS")
    g.add_argument("--tls-key", default=None, help="PEM private key of --tls-cert")
    g.add_argument("--cluster-token-file", type=Path, default=None,
                   help=f"file holding the deployment's cluster token (or set {CLUSTER_TOKEN_ENV}): instances "
                        "present it to register, the scheduler on every call to an instance, and only its holders "
                        "see instance addresses in GetServerInfo; default: no token")
    g.add_argument("--media-key-secret-file", type=Path, default=None,
                   help=f"file holding the deployment's media-key secret (or set {MEDIA_KEY_SECRET_ENV}; `launch` "
                        "makes one): media keys are keyed with it, so no one can forge two images with one key; "
                        "default: a random one of this process (a shared MM Store's features are not found again "
                        "after a restart)")
    g.add_argument("--internal-port", type=int, default=0,
                   help="the instance Registry's own port, never the public one (default 0: a free one, printed "
                        "as 'epdserve scheduler internal: grpc://HOST:PORT')")
    g.add_argument("--internal-host", default="127.0.0.1",
                   help="interface of the internal port (default 127.0.0.1); the cluster network's address when "
                        "instances run on other servers, which needs a cluster token or mutual TLS")
    g.add_argument("--internal-address-file", type=Path, default=None,
                   help="write the internal port's host:port here once serving")
    g.add_argument("--insecure", action="store_true", help=INSECURE_HELP)
    g.add_argument("--internal-tls-cert", default=None,
                   help="mutual TLS with instances (with --internal-port): this scheduler's PEM certificate, served "
                        "on the internal port and presented to instances")
    g.add_argument("--internal-tls-key", default=None, help="PEM private key of --internal-tls-cert")
    g.add_argument("--internal-tls-ca", default=None,
                   help="PEM CA that instances' certificates chain to (instances run with --tls-cert/--tls-key/--tls-ca)")


def security_from_args(args):
    from epdserve.seams.media_keys import MediaKeySecret
    from epdserve.security import Secret
    from epdserve.security.options import SchedulerSecurity

    key = api_key_from_args(args)
    return SchedulerSecurity(
        api_key=Secret(key) if key else None, api_keys_file=getattr(args, "api_keys_file", None),
        cluster_token=Secret.load(file=args.cluster_token_file, env=CLUSTER_TOKEN_ENV),
        media_key_secret=MediaKeySecret.load(file=getattr(args, "media_key_secret_file", None)),
        tls_cert=args.tls_cert, tls_key=args.tls_key, internal_host=args.internal_host,
        internal_port=args.internal_port, internal_tls_cert=args.internal_tls_cert,
        internal_tls_key=args.internal_tls_key, internal_tls_ca=args.internal_tls_ca, insecure=args.insecure)


def api_key_from_args(args) -> str | None:
    if getattr(args, "api_key", None):
        return args.api_key
    path = getattr(args, "api_key_file", None)
    if path is not None:
        key = Path(path).read_text().strip()
        if not key:
            raise ValueError(f"{path}: empty API key file")
        return key
    return os.environ.get(API_KEY_ENV) or None


def metrics_token_from_args(args) -> str | None:
    from epdserve.security import Secret

    token = Secret.load(file=getattr(args, "metrics_token_file", None), env=METRICS_TOKEN_ENV)
    return token.reveal() if token is not None else None


def http_options_from_args(args, security=None):
    if args.http_port is None:
        return None
    from epdserve.entrypoints.http import HttpOptions

    return HttpOptions(
        tenants=security.tenants if security is not None else None, metrics_token=metrics_token_from_args(args),
        allowed_hosts=getattr(args, "allowed_hosts", None) or (),
        max_prompts_per_call=getattr(args, "max_prompts_per_call", 16),
        host=args.http_host or args.host, port=args.http_port, api_key=api_key_from_args(args),
        allow_remote_images=args.allow_remote_images, image_fetch_timeout_s=args.image_fetch_timeout,
        allowed_media_domains=args.allowed_media_domains or (),
        max_image_bytes=args.max_image_bytes, max_body_bytes=args.max_body_bytes,
        served_model_name=args.served_model_name, request_timeout_s=args.http_request_timeout,
        tls_cert=getattr(args, "tls_cert", None), tls_key=getattr(args, "tls_key", None),
    )


class Fronts:
    """The fronts one scheduler process serves besides gRPC (built from the parsed flags).
    `metrics` is the `SchedulerServer`'s observer: build the server with it, then `start`."""

    def __init__(self, http_opts=None, http_address_file: Path | None = None, metrics_port: int | None = None,
                 metrics_host: str = "127.0.0.1", security=None, metrics_auth: str = "auto"):
        from epdserve.metrics import ServingMetrics

        self.security = security  # SchedulerSecurity: the SchedulerServer's
        self.http_opts = http_opts
        self.metrics_auth = metrics_auth  # "auto" | "on" | "off" (--metrics-auth)
        self.http_address_file = http_address_file
        self.metrics_port, self.metrics_host = metrics_port, metrics_host
        self.metrics_token: str | None = None  # --metrics-token-file / EPDSERVE_METRICS_TOKEN
        self.metrics = ServingMetrics()
        self.http = None
        self.metrics_front = None

    @classmethod
    def from_args(cls, args) -> Fronts:
        security = security_from_args(args)
        fronts = cls(http_options_from_args(args, security), getattr(args, "http_address_file", None),
                     getattr(args, "metrics_port", None), getattr(args, "http_host", None) or args.host,
                     security, getattr(args, "metrics_auth", "auto"))
        fronts.metrics_token = metrics_token_from_args(args)
        fronts.security.check_exposure(args.host)  # the gRPC ports (SchedulerServer.start checks again)
        fronts.check_exposure()
        return fronts

    def _metrics_key(self, host: str):
        """What /metrics on `host` requires (None: open), by --metrics-auth: the scrape token, else
        the single API key (`http.tenancy.metrics_matcher`). Auto: whenever a key or token exists."""
        from epdserve.security import Secret

        sec = self.security
        key = Secret(self.metrics_token) if self.metrics_token else sec.api_key if sec is not None else None
        any_key = key is not None or (sec is not None and sec.has_client_keys)
        wanted = self.metrics_auth == "on" or (self.metrics_auth == "auto" and (any_key or not is_loopback(host)))
        if wanted and key is None and (self.metrics_auth == "on" or any_key):
            raise ValueError("/metrics needs a credential: set a scrape token (--metrics-token-file or "
                             f"{METRICS_TOKEN_ENV}) or a single API key (EPDSERVE_API_KEY or --api-key-file); "
                             "keys-file tenants never read /metrics")
        return key if wanted else None

    def check_exposure(self) -> None:
        """Refuse (ExposureError) an HTTP or metrics port beyond loopback that an unauthenticated
        caller could use, before anything starts (unless --insecure)."""
        insecure = self.security is not None and self.security.insecure
        has_key = self.security is not None and self.security.has_client_keys
        if self.http_opts is not None:
            guard("the HTTP front", self.http_opts.host, has_key, "set EPDSERVE_API_KEY (or --api-key-file)", insecure)
            guard("/metrics on the HTTP front", self.http_opts.host, self._metrics_key(self.http_opts.host) is not None,
                  "keep --metrics-auth auto or on, with an API key", insecure)
        if self.metrics_port is not None:
            guard("the metrics port", self.metrics_host, self._metrics_key(self.metrics_host) is not None,
                  "set EPDSERVE_API_KEY and keep --metrics-auth auto or on", insecure)

    async def start(self, scheduler) -> None:
        from epdserve.entrypoints.http import HttpFront, MetricsFront

        self.metrics.attach(scheduler)
        if self.http_opts is not None:
            self.http = HttpFront(scheduler, self.http_opts, self.metrics,
                                  metrics_auth=self._metrics_key(self.http_opts.host) is not None)
            await self.http.start()
            write_atomic(self.http_address_file, self.http.address)
            print(f"epdserve scheduler http: {self.http.url}", flush=True)
        if self.metrics_port is not None:
            tls = self.security if self.security is not None and self.security.tls_cert else None
            self.metrics_front = MetricsFront(self.metrics, self.metrics_host, self.metrics_port,
                                              tls.tls_cert if tls else None, tls.tls_key if tls else None,
                                              api_key=self._metrics_key(self.metrics_host))
            await self.metrics_front.start()
            print(f"epdserve scheduler metrics: {self.metrics_front.url}/metrics", flush=True)

    async def stop(self) -> None:
        for front in (self.http, self.metrics_front):
            if front is not None:
                await front.stop()


def write_atomic(path: Path | None, text: str) -> None:
    """Write `text` to `path` whole (a reader never sees half of it); None: nothing."""
    if path is None:
        return
    tmp = path.with_suffix(path.suffix + ".tmp")
    tmp.write_text(text)
    tmp.replace(path)
