"""The scheduler's fronts beside its gRPC port: the OpenAI-compatible HTTP server (`--http-port`),
the Prometheus metrics (on the HTTP front's /metrics, or alone on `--metrics-port`), and the
security options of gRPC and HTTP alike (API key, cluster token, TLS, internal port, mutual TLS:
`epdserve.security`). `add_front_flags` / `add_security_flags` register the flags on
`epdserve scheduler`; `Fronts` starts them on the scheduler's running loop after the scheduler itself started, and
stops them before it stops. (This composition lives with the entrypoints: nothing in
`epdserve.scheduler` imports the HTTP front.)

The API key comes from --api-key, --api-key-file or the EPDSERVE_API_KEY environment variable
(the last two keep it out of argv, which other users of the machine can read); it is never logged.
"""
from __future__ import annotations

import logging
import os
from pathlib import Path

from epdserve.seams.media_keys import MEDIA_KEY_SECRET_ENV
from epdserve.security.exposure import INSECURE_HELP, guard, is_loopback
from epdserve.security.secrets import API_KEY_ENV, CLUSTER_TOKEN_ENV

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
                   help="seconds for one remote image's whole fetch, redirects and body included (default 10)")
    g.add_argument("--max-image-bytes", type=int, default=20 * 1024 * 1024, help="per image (default 20 MiB)")
    g.add_argument("--max-body-bytes", type=int, default=64 * 1024 * 1024,
                   help="larger HTTP request bodies are refused with 413 (default 64 MiB)")
    g.add_argument("--http-request-timeout", type=float, default=None,
                   help="end an HTTP request still running after this many seconds with 504 (default: none)")
    g.add_argument("--http-address-file", type=Path, default=None, help="write the HTTP host:port here once serving")
    g.add_argument("--metrics-port", type=int, default=None,
                   help="serve Prometheus /metrics alone on this port (0: a free one), for gRPC-only deployments "
                        "(HTTPS with --tls-cert/--tls-key); with --http-port they are also on the HTTP front's /metrics")
    g.add_argument("--metrics-auth", choices=("auto", "on", "off"), default="auto",
                   help="/metrics needs the API key ('authorization: Bearer KEY'; Prometheus: "
                        "authorization.credentials_file): on, off, or auto (default) = on when the port serving "
                        "/metrics is bound beyond loopback. Off beyond loopback is refused unless --insecure")


def add_security_flags(p) -> None:
    g = p.add_argument_group("security")
    g.add_argument("--api-key", default=None,
                   help=f"API key clients must send (gRPC metadata / HTTP header 'authorization: Bearer <key>'); "
                        f"visible to other local users in argv: prefer {API_KEY_ENV} or --api-key-file")
    g.add_argument("--api-key-file", type=Path, default=None,
                   help=f"file holding the API key clients must send as 'Authorization: Bearer <key>' "
                        f"(or set {API_KEY_ENV}); default: no key")
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
        api_key=Secret(key) if key else None,
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


def http_options_from_args(args):
    if args.http_port is None:
        return None
    from epdserve.entrypoints.http import HttpOptions

    return HttpOptions(
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
        self.metrics = ServingMetrics()
        self.http = None
        self.metrics_front = None

    @classmethod
    def from_args(cls, args) -> Fronts:
        fronts = cls(http_options_from_args(args), getattr(args, "http_address_file", None),
                     getattr(args, "metrics_port", None), getattr(args, "http_host", None) or args.host,
                     security_from_args(args), getattr(args, "metrics_auth", "auto"))
        fronts.security.check_exposure(args.host)  # the gRPC ports (SchedulerServer.start checks again)
        fronts.check_exposure()
        return fronts

    def _metrics_key(self, host: str):
        """The API key /metrics on `host` requires (None: open), by --metrics-auth."""
        key = self.security.api_key if self.security is not None else None
        wanted = self.metrics_auth == "on" or (self.metrics_auth == "auto" and not is_loopback(host))
        if wanted and key is None and self.metrics_auth == "on":
            raise ValueError("--metrics-auth on needs an API key (EPDSERVE_API_KEY or --api-key-file)")
        return key if wanted else None

    def check_exposure(self) -> None:
        """Refuse (ExposureError) an HTTP or metrics port beyond loopback that an unauthenticated
        caller could use, before anything starts (unless --insecure)."""
        insecure = self.security is not None and self.security.insecure
        has_key = self.security is not None and self.security.api_key is not None
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
