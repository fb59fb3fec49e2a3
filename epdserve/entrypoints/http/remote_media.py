"""Fetching one remote media URL without SSRF: `fetch_remote(url, policy)` (blocking: callers run
it in a worker thread) returns the body or raises `FetchFailed`.

Every hop — the URL, then at most `MAX_REDIRECTS` redirects — is checked alike: http or https, no
``user:password@``, a host `MediaDomains` admits; the host is resolved once (getaddrinfo, which
also turns numeric spellings such as ``2130706433`` or ``0x7f.1`` into the address they mean) and
refused when any address is (`address_refusal`; an allow-listed host only for a cloud metadata
address). The connection then goes to those resolved addresses, never looking the name up again
(a DNS answer cannot change between the check and the connect), with TLS verified against the
URL's host name. One deadline bounds the whole fetch — connects, TLS, headers, redirects, body: a
watchdog shuts the open socket when it passes, so a slow-drip server cannot stretch it. The body
is read in chunks and refused at `max_bytes` + 1 (`TooLarge`). Proxy variables (HTTP_PROXY) are
not used.

`FetchFailed.reason` says why in detail, for the DEBUG log only; it never carries a fetched byte
(HTTP-library errors are named by type, the rest escaped to printable ASCII). The caller shows one
uniform text whatever the reason, so the fetcher cannot be used to scan ports.
"""
from __future__ import annotations

import http.client
import ipaddress
import socket
import ssl
import threading
import time
from dataclasses import dataclass
from urllib.parse import urljoin, urlsplit

from epdserve.entrypoints.http.media_address import MediaDomains, address_refusal, is_metadata

MAX_REDIRECTS = 3
_REDIRECTS = frozenset({301, 302, 303, 307, 308})
_CHUNK = 64 * 1024
_HEADERS = {"User-Agent": "epdserve", "Accept": "image/*", "Accept-Encoding": "identity", "Connection": "close"}


class FetchFailed(Exception):
    """The fetch failed; `reason` (printable ASCII, no fetched bytes) is for the DEBUG log."""

    def __init__(self, reason: str):
        self.reason = reason.encode("ascii", "backslashreplace").decode()[:300]
        super().__init__(self.reason)


class TooLarge(FetchFailed):
    """The body is larger than the cap (the one failure the caller may tell apart)."""


@dataclass(frozen=True)
class FetchPolicy:
    """domains: the allow-list. max_bytes / timeout_s: the caps on one fetch, redirects included.
    tls: the context https is verified with (None: the system's CAs)."""

    domains: MediaDomains
    max_bytes: int
    timeout_s: float
    tls: ssl.SSLContext | None = None


def fetch_remote(url: str, policy: FetchPolicy) -> bytes:
    """The body of `url` (status 200, after at most `MAX_REDIRECTS` checked redirects)."""
    with _Deadline(policy.timeout_s) as deadline:
        for hop in range(MAX_REDIRECTS + 1):
            try:
                target = _Target.parse(url)
                status, location, body = _get(target, _resolve(target, policy.domains), policy, deadline)
            except FetchFailed as e:
                if hop:
                    e.reason = f"redirect {hop}: {e.reason}"
                raise
            if status == 200:
                return body
            if status not in _REDIRECTS or not location:
                raise FetchFailed(f"HTTP status {status} from {target.host}")
            url = urljoin(url, location)
        raise FetchFailed(f"more than {MAX_REDIRECTS} redirects")


@dataclass(frozen=True)
class _Target:
    scheme: str
    host: str
    port: int
    path: str

    @classmethod
    def parse(cls, url: str) -> _Target:
        try:
            parts = urlsplit(url)
            port = parts.port
        except ValueError:
            raise FetchFailed("not a valid URL") from None
        if parts.scheme not in ("http", "https"):
            raise FetchFailed(f"scheme {parts.scheme!r} is neither http nor https")
        if "@" in parts.netloc:
            raise FetchFailed("the URL carries user:password@")
        if not parts.hostname:
            raise FetchFailed("the URL has no host")
        path = (parts.path or "/") + (f"?{parts.query}" if parts.query else "")
        return cls(parts.scheme, parts.hostname, port or (443 if parts.scheme == "https" else 80), path)


def _resolve(target: _Target, domains: MediaDomains) -> list[tuple]:
    """The host's addresses, resolved once, as (family, type, proto, sockaddr); refused when the
    allow-list leaves the host out or any address is off limits."""
    allowed = domains.allows(target.host)
    if domains and not allowed:
        raise FetchFailed(f"{target.host} is not in --allowed-media-domains")
    try:
        infos = socket.getaddrinfo(target.host, target.port, type=socket.SOCK_STREAM, proto=socket.IPPROTO_TCP)
    except (OSError, UnicodeError, ValueError) as e:
        raise FetchFailed(f"cannot resolve {target.host}: {e}") from None
    addrs = []
    for family, type_, proto, _, sockaddr in infos:
        ip = ipaddress.ip_address(str(sockaddr[0]).partition("%")[0])
        why = "a cloud metadata address" if is_metadata(ip) else None if allowed else address_refusal(ip)
        if why:
            raise FetchFailed(f"{target.host} resolves to {ip}, {why}")
        addrs.append((family, type_, proto, sockaddr))
    if not addrs:
        raise FetchFailed(f"{target.host} resolves to no address")
    return addrs


def _get(target: _Target, addrs: list[tuple], policy: FetchPolicy, deadline: _Deadline) -> tuple:
    """(status, Location or None, body): the body read only for a 200, at most max_bytes + 1."""
    tls = (policy.tls or ssl.create_default_context()) if target.scheme == "https" else None
    conn = None
    try:
        conn = _PinnedConnection(target, addrs, deadline, tls)
        conn.request("GET", target.path, headers=_HEADERS)
        resp = conn.getresponse()
        if resp.status != 200:
            return resp.status, resp.getheader("Location"), b""
        length = resp.getheader("Content-Length")
        if length is not None and length.strip().isdigit() and int(length) > policy.max_bytes:
            raise TooLarge(f"Content-Length {int(length)} > {policy.max_bytes}")
        body, n = [], 0
        while chunk := _read(resp, deadline):
            n += len(chunk)
            if n > policy.max_bytes:
                raise TooLarge(f"more than {policy.max_bytes} bytes")
            body.append(chunk)
        return 200, None, b"".join(body)
    except FetchFailed:
        raise
    except Exception as e:  # any failure past the checks reads the same to the caller
        raise FetchFailed(deadline.explain(target, e)) from None
    finally:
        if conn is not None:
            conn.release()


def _read(resp: http.client.HTTPResponse, deadline: _Deadline) -> bytes:
    deadline.tighten()
    return resp.read(_CHUNK)


class _PinnedConnection(http.client.HTTPConnection):
    """HTTP(S) to the addresses resolved already (tried in order), the URL's host name in the Host
    header and, for https, in SNI and the certificate check."""

    def __init__(self, target: _Target, addrs: list[tuple], deadline: _Deadline, tls: ssl.SSLContext | None):
        super().__init__(target.host, target.port, timeout=deadline.left())
        self.default_port = 443 if tls is not None else 80  # Host: has the port only when it is not the default
        self._addrs, self._deadline, self._tls = addrs, deadline, tls
        self._socket: socket.socket | None = None

    def close(self) -> None:
        """http.client closes its socket once a closing response's head is read; the body is still
        read through it, with the deadline's timeouts and watchdog on it: `release` closes it."""
        self.sock = None
        super().close()

    def release(self) -> None:
        self.close()
        if self._socket is not None:
            self._socket.close()

    def connect(self) -> None:
        error: BaseException | None = None
        for family, type_, proto, sockaddr in self._addrs:
            sock = socket.socket(family, type_, proto)
            self._deadline.watch(sock)
            try:
                sock.settimeout(self._deadline.left())
                sock.connect(sockaddr)
                if self._tls is not None:
                    sock = self._tls.wrap_socket(sock, server_hostname=self.host)
                    self._deadline.watch(sock)
                self.sock = self._socket = sock
                return
            except (OSError, FetchFailed) as e:
                sock.close()
                if isinstance(e, (FetchFailed, ssl.SSLError)):
                    raise
                error = e
        raise error


class _Deadline:
    """One time limit for a whole fetch: `left()` the seconds that remain (FetchFailed when none
    do); a timer shuts the socket being used (`watch`) the moment it passes, which ends any read
    or connect blocked on it."""

    def __init__(self, seconds: float):
        self.seconds = seconds
        self._end = time.monotonic() + seconds
        self._lock = threading.Lock()
        self._sock: socket.socket | None = None
        self.expired = False
        self._timer = threading.Timer(seconds, self._expire)
        self._timer.daemon = True

    def __enter__(self) -> _Deadline:
        self._timer.start()
        return self

    def __exit__(self, *exc) -> None:
        self._timer.cancel()

    def left(self) -> float:
        left = self._end - time.monotonic()
        if left <= 0 or self.expired:
            raise FetchFailed(f"the fetch took longer than {self.seconds} s")
        return left

    def watch(self, sock: socket.socket) -> None:
        with self._lock:
            self._sock = sock
            if self.expired:
                _shut(sock)

    def tighten(self) -> None:
        """Bound the next socket operation by what is left as well."""
        left = self.left()
        with self._lock:
            if self._sock is not None:
                self._sock.settimeout(left)

    def explain(self, target: _Target, e: BaseException) -> str:
        """A failure past the checks in words: TLS and socket errors by their text, an HTTP
        library's (whose text may quote what the server sent) by type only."""
        if self.expired or isinstance(e, TimeoutError):
            return f"the fetch took longer than {self.seconds} s"
        if isinstance(e, ssl.SSLError):
            return f"TLS with {target.host} failed: {e.reason or type(e).__name__}"
        if isinstance(e, OSError) and e.strerror:
            return f"{type(e).__name__} from {target.host}: {e.strerror}"
        return f"{type(e).__name__} from {target.host}"

    def _expire(self) -> None:
        with self._lock:
            self.expired = True
            if self._sock is not None:
                _shut(self._sock)


def _shut(sock: socket.socket) -> None:
    """Shut the connection under `sock` (an SSLSocket too: the plain socket's shutdown acts on the
    descriptor without touching the TLS state another thread may be using)."""
    try:
        socket.socket.shutdown(sock, socket.SHUT_RDWR)
    except OSError:
        pass
