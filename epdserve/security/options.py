"""`SchedulerSecurity` / `InstanceSecurity`: what one process checks and presents.

Scheduler: the public port (EPDServe) needs the API key when one is set (the cluster token is
accepted too: the launcher and operators' tools hold it); the Registry, and every other
internal RPC, is never on the public port: it has its own (`internal_host:internal_port`,
loopback unless bound to the cluster network) and needs the cluster token when one is set;
every call to an instance carries the token; GetServerInfo lists instance addresses only to
callers holding the token (nobody, without one). `check_exposure` refuses a public port beyond
loopback without an API key and an internal one without the token or mutual TLS
(`security.exposure`; `insecure` lets them start with a warning). TLS on the public
port with `tls_cert`/`tls_key`. Mutual TLS between scheduler and instances with
`internal_tls_*`: the internal port requires client certificates signed by `internal_tls_ca`,
and the scheduler dials instances over TLS, presenting its certificate and trusting that CA.
The scheduler also holds the deployment's media-key secret (`media_key_secret`, from
EPDSERVE_MEDIA_KEY_SECRET or --media-key-secret-file): it keys every media item it receives
(`seams.media_keys`); instances take its keys and need none.
Instance: every Instance-service call needs the cluster token; Register/Heartbeat carry it; its
port beyond loopback needs the token or mutual TLS (`check_exposure`).
With `tls_*`, its port is TLS-only and requires a client certificate signed by `tls_ca` (the
scheduler's), and it registers over TLS, presenting its own certificate.
"""
from __future__ import annotations

from dataclasses import dataclass

from epdserve.seams.media_keys import MEDIA_KEY_SECRET_ENV, MediaKeySecret
from epdserve.security.exposure import INSECURE_HELP, guard
from epdserve.security.interceptors import Rule
from epdserve.security.secrets import (API_KEY_ENV, AUTHORIZATION, CLUSTER_TOKEN_ENV, CLUSTER_TOKEN_HEADER,
                                       Secret, bearer)
from epdserve.security.tenants import DEFAULT_TENANT, TenantKeys, client_keys

SERVE_PREFIX = "/epdserve.v1.EPDServe/"
REGISTRY_PREFIX = "/epdserve.v1.Registry/"
INSTANCE_PREFIX = "/epdserve.v1.Instance/"


@dataclass
class SchedulerSecurity:
    api_key: Secret | None = None
    cluster_token: Secret | None = None
    tls_cert: str | None = None
    tls_key: str | None = None
    internal_host: str = "127.0.0.1"  # the Registry's interface: loopback unless the cluster network is named
    internal_port: int = 0  # the Registry's own port (0: a free one)
    internal_tls_cert: str | None = None  # mutual TLS with instances: this side's certificate ...
    internal_tls_key: str | None = None
    internal_tls_ca: str | None = None  # ... and the CA both sides' certificates chain to
    insecure: bool = False  # --insecure: unauthenticated listeners beyond loopback start, with a warning
    media_key_secret: MediaKeySecret | None = None  # what media keys are keyed with (None: the process's own)
    api_keys_file: str | None = None  # --api-keys-file: '<tenant> <key>' per line (security/tenants.py)

    def __post_init__(self):
        self.tenants: TenantKeys | None = client_keys(self.api_key, self.api_keys_file)
        if bool(self.tls_cert) != bool(self.tls_key):
            raise ValueError("--tls-cert and --tls-key go together")
        internal = (self.internal_tls_cert, self.internal_tls_key, self.internal_tls_ca)
        if any(internal) and not all(internal):
            raise ValueError("--internal-tls-cert, --internal-tls-key and --internal-tls-ca go together")
        self.internal_host = self.internal_host or "127.0.0.1"
        self.internal_port = int(self.internal_port or 0)
        if not 0 <= self.internal_port < 65536:
            raise ValueError(f"internal port must be 0..65535, got {self.internal_port}")

    @property
    def mutual_tls(self) -> bool:
        return bool(self.internal_tls_cert)

    @classmethod
    def from_env(cls, **kw) -> SchedulerSecurity:
        kw.setdefault("api_key", Secret.load(env=API_KEY_ENV))
        kw.setdefault("cluster_token", Secret.load(env=CLUSTER_TOKEN_ENV))
        kw.setdefault("media_key_secret", MediaKeySecret.load(env=MEDIA_KEY_SECRET_ENV))
        return cls(**kw)

    def public_rules(self) -> list[Rule]:
        rules = []
        if self.tenants is not None:
            accepts = [(AUTHORIZATION, self.tenants)]
            if self.cluster_token is not None:
                accepts.append((CLUSTER_TOKEN_HEADER, self.cluster_token))
            rules.append(Rule(SERVE_PREFIX, accepts, "API key"))
        return rules

    def internal_rules(self) -> list[Rule]:
        if self.cluster_token is None:
            return []
        return [Rule(REGISTRY_PREFIX, [(CLUSTER_TOKEN_HEADER, self.cluster_token)], "cluster token")]

    def check_exposure(self, public_host: str) -> None:
        """Refuse (ExposureError) to serve the public port beyond loopback without an API key, or
        the internal one without the cluster token or mutual TLS (unless `insecure`)."""
        guard("the public gRPC port", public_host, self.has_client_keys,
              "set EPDSERVE_API_KEY (or --api-key-file)", self.insecure)
        guard("the instance Registry (internal port)", self.internal_host,
              self.cluster_token is not None or self.mutual_tls,
              "set EPDSERVE_CLUSTER_TOKEN (or --cluster-token-file), or mutual TLS (--internal-tls-*)", self.insecure)

    @property
    def has_client_keys(self) -> bool:
        """A key is needed on the public services (the single key or a keys file)."""
        return self.tenants is not None

    def tenant_of(self, metadata) -> str | None:
        """The caller's tenant from its gRPC metadata: the one its API key names; the default
        tenant for a cluster-token holder, and for everyone where no key is set; None: neither."""
        if self.tenants is None:
            return DEFAULT_TENANT
        md = {k: v for k, v in (metadata or ()) if isinstance(v, str)}
        tenant = self.tenants.tenant_of(bearer(md.get(AUTHORIZATION)))
        if tenant is None and self.holds_token(metadata):
            return DEFAULT_TENANT
        return tenant

    def tenant_weight(self, tenant: str) -> float:
        """A tenant's weight for fair share (the keys file's ``@weight``; 1 without a keys file)."""
        return self.tenants.weight(tenant) if self.tenants is not None else 1.0

    def holds_token(self, metadata) -> bool:
        """May this caller see instance addresses? Only a holder of the cluster token (nobody,
        when the deployment has none)."""
        if self.cluster_token is None:
            return False
        md = {k: v for k, v in (metadata or ())}
        return self.cluster_token.matches(md.get(CLUSTER_TOKEN_HEADER))


@dataclass
class InstanceSecurity:
    cluster_token: Secret | None = None
    tls_cert: str | None = None
    tls_key: str | None = None
    tls_ca: str | None = None
    insecure: bool = False  # --insecure: an unauthenticated port beyond loopback starts, with a warning

    def __post_init__(self):
        tls = (self.tls_cert, self.tls_key, self.tls_ca)
        if any(tls) and not all(tls):
            raise ValueError("--tls-cert, --tls-key and --tls-ca go together")

    @classmethod
    def from_env(cls, **kw) -> InstanceSecurity:
        return cls(Secret.load(env=CLUSTER_TOKEN_ENV), **kw)

    @classmethod
    def from_args(cls, args) -> InstanceSecurity:
        return cls.from_env(tls_cert=getattr(args, "tls_cert", None), tls_key=getattr(args, "tls_key", None),
                            tls_ca=getattr(args, "tls_ca", None), insecure=bool(getattr(args, "insecure", False)))

    @property
    def mutual_tls(self) -> bool:
        return bool(self.tls_cert)

    def check_exposure(self, bind_host: str) -> None:
        """Refuse (ExposureError) to serve the Instance port beyond loopback without the cluster
        token or mutual TLS (unless `insecure`)."""
        guard("the instance's gRPC port", bind_host, self.cluster_token is not None or self.mutual_tls,
              "set EPDSERVE_CLUSTER_TOKEN, or mutual TLS (--tls-cert/--tls-key/--tls-ca)", self.insecure)

    def rules(self) -> list[Rule]:
        if self.cluster_token is None:
            return []
        return [Rule(INSTANCE_PREFIX, [(CLUSTER_TOKEN_HEADER, self.cluster_token)], "cluster token")]


def add_instance_security_flags(p) -> None:
    g = p.add_argument_group("security (the cluster token comes from EPDSERVE_CLUSTER_TOKEN)")
    g.add_argument("--tls-cert", default=None, help="PEM certificate: mutual TLS with the scheduler (this port is "
                                                    "TLS-only and registration goes over TLS)")
    g.add_argument("--tls-key", default=None, help="PEM private key of --tls-cert")
    g.add_argument("--tls-ca", default=None, help="PEM CA the scheduler's certificate (and ours) chains to")
    g.add_argument("--insecure", action="store_true", help=INSECURE_HELP)
