"""MM Store URLs: which Redis topology a URL names, its parts, and the URL without its password.

    redis://[user:pass@]host:port[/db][?opts]       one server (also rediss:// with TLS, unix://)
    redis+cluster://[user:pass@]host:port[,host:port...][?opts]
                                                    a Redis Cluster: the nodes to discover it from
    redis+sentinel://[user:pass@]host:port[,host:port...]/service_name[/db][?opts]
                                                    primary/replicas watched by Sentinel: the sentinels
    rediss+cluster://, rediss+sentinel://           the same over TLS (every node, every sentinel)

redis-py parses only the first form (`redis.connection.parse_url`). The `+cluster` / `+sentinel`
forms follow the convention of other clients (Sentinel: the redis-sentinel-url package, LangChain,
redisvl, Prefect's `redis+sentinel://`; Cluster: pomerium's `redis+cluster://`): a comma-separated
member list, the Sentinel service name as the path. The user/password are the data nodes'
(`requirepass` / ACL); sentinels that need their own give them as `?sentinel_password=` (and
`sentinel_username=`), as Prefect does, or in the environment (`SENTINEL_PASSWORD_ENV`),
which keeps it out of command lines; `without_secrets` moves a URL's passwords out of it (what
`epdserve launch` hands its children: the URL without them, the passwords in their environment). Every other query option is redis-py's own, applied to
the data nodes by redis-py's parsing: this module rewrites a member URL and hands it over.
Default ports: 6379 for nodes, 26379 for sentinels.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from urllib.parse import parse_qsl, unquote, urlencode, urlsplit, urlunsplit

SINGLE, CLUSTER, SENTINEL = "single", "cluster", "sentinel"
_KINDS = {"redis": SINGLE, "rediss": SINGLE, "unix": SINGLE, "redis+cluster": CLUSTER,
          "rediss+cluster": CLUSTER, "redis+sentinel": SENTINEL, "rediss+sentinel": SENTINEL}
_SENTINEL_OPTIONS = ("sentinel_password", "sentinel_username")
SENTINEL_PASSWORD_ENV = "EPDSERVE_MM_STORE_SENTINEL_PASSWORD"  # the sentinels' password, when the URL has none


@dataclass(frozen=True)
class StoreURL:
    kind: str  # SINGLE, CLUSTER or SENTINEL
    node_url: str  # a redis[s]:// URL for redis-py: auth, db and options (cluster: its first node)
    members: tuple[tuple[str, int], ...] = ()  # cluster: startup nodes; sentinel: the sentinels
    service: str | None = None  # sentinel: the monitored primary's name
    tls: bool = False
    sentinel_auth: dict = field(default_factory=dict)  # password / username for the sentinels


def parse(url: str) -> StoreURL:
    """Raises ValueError (password redacted) for an unknown scheme or a malformed member list."""
    parts = urlsplit(url)
    kind = _KINDS.get(parts.scheme)
    if kind is None:
        raise ValueError(f"MM Store URL must start with one of {', '.join(s + '://' for s in _KINDS)}; "
                         f"got {redact(url)!r}")
    if kind == SINGLE:
        return StoreURL(SINGLE, url, tls=parts.scheme == "rediss")
    tls = parts.scheme.startswith("rediss")
    userinfo, _, hosts = parts.netloc.rpartition("@")
    default_port = 26379 if kind == SENTINEL else 6379
    members = tuple(_host_port(h, default_port, url) for h in hosts.split(",") if h.strip())
    if not members:
        raise ValueError(f"MM Store URL {redact(url)!r} names no host")
    path = [unquote(p) for p in parts.path.split("/") if p]
    query = parse_qsl(parts.query, keep_blank_values=True)
    sentinel_auth = {k.removeprefix("sentinel_"): v for k, v in query if k in _SENTINEL_OPTIONS}
    query = [(k, v) for k, v in query if k not in _SENTINEL_OPTIONS]
    service = None
    if kind == SENTINEL:
        if not path or len(path) > 2:
            raise ValueError(f"a Sentinel URL ends in /service_name[/db]; got {redact(url)!r}")
        service, db = path[0], (path[1] if len(path) == 2 else "0")
    else:
        if len(path) > 1 or (path and path[0] != "0"):
            raise ValueError(f"a Redis Cluster has database 0 only; got {redact(url)!r}")
        db = "0"
    host, port = members[0]
    netloc = (userinfo + "@" if userinfo else "") + (f"[{host}]" if ":" in host else host) + f":{port}"
    node_url = urlunsplit(("rediss" if tls else "redis", netloc, f"/{db}", urlencode(query), ""))
    return StoreURL(kind, node_url, members, service, tls, sentinel_auth)


def redact(url: str) -> str:
    """``url`` without its password (nor a ``sentinel_password`` option), for logs and errors."""
    parts = urlsplit(url)
    userinfo, at, hosts = parts.netloc.rpartition("@")
    if at and ":" in userinfo:
        userinfo = userinfo.split(":", 1)[0] + ":***"
    query = "&".join(p if not p.startswith("sentinel_password=") else "sentinel_password=***"
                     for p in parts.query.split("&")) if parts.query else ""
    return urlunsplit(parts._replace(netloc=userinfo + at + hosts, query=query))


def without_secrets(url: str) -> tuple[str, str | None, str | None]:
    """(`url` without its password and its ``sentinel_password`` option, the password, the
    sentinel password), the passwords decoded as redis-py decodes them; the user name stays."""
    parts = urlsplit(url)
    userinfo, at, hosts = parts.netloc.rpartition("@")
    password = None
    if at and ":" in userinfo:
        user, _, raw = userinfo.partition(":")
        password = unquote(raw) or None
        userinfo, at = user, "@" if user else ""
    query = parse_qsl(parts.query, keep_blank_values=True)
    sentinel = next((unquote(v) for k, v in query if k == "sentinel_password"), None) or None
    kept = urlencode([(k, v) for k, v in query if k != "sentinel_password"])
    return urlunsplit(parts._replace(netloc=userinfo + at + hosts, query=kept)), password, sentinel


def _host_port(member: str, default_port: int, url: str) -> tuple[str, int]:
    member = member.strip()
    if member.startswith("["):  # [IPv6]:port
        host, _, rest = member[1:].partition("]")
        port = rest.removeprefix(":")
    else:
        host, _, port = member.rpartition(":") if ":" in member else (member, "", "")
    try:
        return host, int(port) if port else default_port
    except ValueError:
        raise ValueError(f"bad host:port {member!r} in MM Store URL {redact(url)!r}") from None
