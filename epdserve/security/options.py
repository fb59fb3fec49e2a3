"""`SchedulerSecurity` / `InstanceSecurity`: what one process checks and presents.

Scheduler: the public port (EPDServe) needs the API key when one is set (the cluster token is
accepted too: the launcher and operators' tools hold it); the Registry needs the cluster token
when one is set, and moves to its own port (`internal_host:internal_port`, e.g. bound to the
cluster network) when that is given; every call to an instance carries the token;
GetServerInfo lists instance addresses only to callers holding the token. TLS on the public
port with `tls_cert`/`tls_key`. Mutual TLS between scheduler and instances with
`internal_tls_*`: the internal port requires client certificates signed by `internal_tls_ca`,
and the scheduler dials instances over TLS, presenting its certificate and trusting that CA.
Instance: every Instance-service call needs the cluster token; Register/Heartbeat carry it.
With `tls_*`, its port is TLS-only and requires a client certificate signed by `tls_ca` (the
scheduler's), and it registers over TLS, presenting its own certificate.
"""
from __future__ import annotations

from dataclasses import dataclass

from epdserve.security.interceptors import Rule
from epdserve.security.secrets import (API_KEY_ENV, AUTHORIZATION, CLUSTER_TOKEN_ENV, CLUSTER_TOKEN_HEADER,
                                       Secret)

SERVE_PREFIX = "/epdserve.v1.EPDServe/"
REGISTRY_PREFIX = "/epdserve.v1.Registry/"
INSTANCE_PREFIX = "/epdserve.v1.Instance/"


@dataclass
class SchedulerSecurity:
    api_key: Secret | None = None
    cluster_token: Secret | None = None
    tls_cert: str | None = None
    tls_key: str | None = None
    internal_host: str | None = None
    internal_port: int | None = None  # None: the Registry is on the public port
    internal_tls_cert: str | None = None  # mutual TLS with instances: this side's certificate ...
    internal_tls_key: str | None = None
    internal_tls_ca: str | None = None  # ... and the CA both sides' certificates chain to

    def __post_init__(self):
        if bool(self.tls_cert) != bool(self.tls_key):
            raise ValueError("--tls-cert and --tls-key go together")
        internal = (self.internal_tls_cert, self.internal_tls_key, self.internal_tls_ca)
        if any(internal) and not all(internal):
            raise ValueError("--internal-tls-cert, --internal-tls-key and --internal-tls-ca go together")
        if all(internal) and self.internal_port is None:
            raise ValueError("mutual TLS with instances needs --internal-port (the Registry's own port)")
        if self.internal_port is not None and not 0 <= int(self.internal_port) < 65536:
            raise ValueError(f"internal port must be 0..65535, got {self.internal_port}")

    @property
    def mutual_tls(self) -> bool:
        return bool(self.internal_tls_cert)

    @classmethod
    def from_env(cls, **kw) -> SchedulerSecurity:
        kw.setdefault("api_key", Secret.load(env=API_KEY_ENV))
        kw.setdefault("cluster_token", Secret.load(env=CLUSTER_TOKEN_ENV))
        return cls(**kw)

    def public_rules(self) -> list[Rule]:
        rules = []
        if self.api_key is not None:
            accepts = [(AUTHORIZATION, self.api_key)]
            if self.cluster_token is not None:
                accepts.append((CLUSTER_TOKEN_HEADER, self.cluster_token))
            rules.append(Rule(SERVE_PREFIX, accepts, "API key"))
        if self.internal_port is None:
            rules += self.internal_rules()
        return rules

    def internal_rules(self) -> list[Rule]:
        if self.cluster_token is None:
            return []
        return [Rule(REGISTRY_PREFIX, [(CLUSTER_TOKEN_HEADER, self.cluster_token)], "cluster token")]

    def holds_token(self, metadata) -> bool:
        """May this caller see instance addresses? (Everyone, when no token is configured.)"""
        if self.cluster_token is None:
            return True
        md = {k: v for k, v in (metadata or ())}
        return self.cluster_token.matches(md.get(CLUSTER_TOKEN_HEADER))


@dataclass
class InstanceSecurity:
    cluster_token: Secret | None = None
    tls_cert: str | None = None
    tls_key: str | None = None
    tls_ca: str | None = None

    def __post_init__(self):
        tls = (self.tls_cert, self.tls_key, self.tls_ca)
        if any(tls) and not all(tls):
            raise ValueError("--tls-cert, --tls-key and --tls-ca go together")

    @classmethod
    def from_env(cls, **tls) -> InstanceSecurity:
        return cls(Secret.load(env=CLUSTER_TOKEN_ENV), **tls)

    @classmethod
    def from_args(cls, args) -> InstanceSecurity:
        return cls.from_env(tls_cert=getattr(args, "tls_cert", None), tls_key=getattr(args, "tls_key", None),
                            tls_ca=getattr(args, "tls_ca", None))

    @property
    def mutual_tls(self) -> bool:
        return bool(self.tls_cert)

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
