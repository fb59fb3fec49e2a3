"""`Fence`: what the HTTP front refuses before any route runs, so that loopback is a boundary a
web page cannot cross.

- **Host allow-list** (DNS rebinding: a page on ``evil.example`` whose name is re-pointed at
  127.0.0.1 talks to the server as same-origin, with ``Host: evil.example``): a request whose
  Host header names none of `HostAllowList`'s hosts is refused with 400. Allowed: ``localhost``,
  every loopback address, the address the front is bound to (every interface address and this
  machine's names when bound to all interfaces), and the operator's ``--allowed-hosts``
  (exact names, ``.example.com`` for every name under it, ``*`` for any host). A request
  without a Host header (HTTP/1.0; no browser sends one) passes. The list is enforced on a
  front bound to loopback, on any front without an API key, and wherever ``--allowed-hosts``
  is given; a keyed front beyond loopback without it (a Kubernetes Service, an ingress: names
  the process cannot know) answers any Host, its key being what a rebound page cannot send.
- **JSON only on POST** (a cross-origin ``text/plain`` POST needs no CORS preflight, and was
  parsed as JSON): a POST whose Content-Type is not ``application/json`` is refused with 415;
  the one exception is ``multipart/form-data`` on ``/v1/files`` (OpenAI's Files API takes no
  other), which a cross-site form could send too: there a request whose ``Origin`` header (every
  browser sends one on a cross-origin POST) names a host off the allow-list is refused with 403.

Both answer in OpenAI's error shape (`errors.ApiError`) and are counted as every response is.
"""
from __future__ import annotations

import ipaddress
import re
import socket
from urllib.parse import urlsplit

from epdserve.entrypoints.http.errors import ApiError
from epdserve.security.exposure import is_loopback

_ANY = ("", "0.0.0.0", "::", "[::]", "*")
_PORT = re.compile(r"(:[0-9]+)?")  # what may follow a Host header's host: nothing, or ASCII digits of a port
UPLOAD_PATH = "/v1/files"  # multipart bodies are OpenAI's Files API's (files.py)


def _name(host: str) -> str:
    """A Host header's host part, lower-case, without port, brackets or a trailing dot; "" (a name
    nothing allows) when anything but ``:PORT`` follows the host (``[::1]evil``,
    ``localhost:evil``): what follows is never ignored."""
    host = host.strip().lower()
    if host.startswith("["):
        end = host.find("]")
        if end == -1 or not _PORT.fullmatch(host[end + 1:]):
            return ""
        host = host[1:end]
    elif host.count(":") == 1:
        host, port = host.rsplit(":", 1)
        if not _PORT.fullmatch(":" + port):
            return ""
    return host.rstrip(".")


def _local_names() -> set[str]:
    """Every address of this machine's interfaces and its names (a front bound to all of them)."""
    names = {socket.gethostname().lower(), socket.getfqdn().lower()}
    try:
        import psutil

        for addrs in psutil.net_if_addrs().values():
            names.update(a.address.split("%")[0].lower() for a in addrs
                         if a.family in (socket.AF_INET, socket.AF_INET6))
    except Exception:  # psutil missing or an interface we cannot read: the names above stay
        pass
    return names


class HostAllowList:
    """`bound`: the host the front binds; `extra`: --allowed-hosts entries; `keyed`: the front
    needs an API key (with no `extra` and `bound` beyond loopback, any Host passes)."""

    def __init__(self, bound: str, extra: tuple[str, ...] | list[str] = (), keyed: bool = False):
        entries = [e.strip().lower() for e in extra if e.strip()]
        self.any = "*" in entries or (keyed and not entries and not is_loopback(bound))
        self.suffixes = tuple(e for e in entries if e.startswith("."))
        self.names = {"localhost"} | {_name(e) for e in entries if not e.startswith(".") and e != "*"}
        self.names.add(_name(bound) if bound not in _ANY else "127.0.0.1")
        if bound in _ANY:
            self.names |= _local_names()

    def allows(self, host_header: str | None) -> bool:
        if self.any or host_header is None:
            return True
        name = _name(host_header)
        if name in self.names or name.endswith(".localhost") or any(name.endswith(s) for s in self.suffixes):
            return True
        try:
            return ipaddress.ip_address(name).is_loopback
        except ValueError:
            return False


def parse_allowed_hosts(value: str | tuple | list | None) -> tuple[str, ...]:
    """--allowed-hosts (comma-separated) as entries."""
    if not value:
        return ()
    items = value.split(",") if isinstance(value, str) else value
    return tuple(i.strip() for i in items if i.strip())


class Fence:
    """ASGI middleware: the Host allow-list and JSON-only POSTs (module docstring)."""

    def __init__(self, app, hosts: HostAllowList):
        self.app, self.hosts = app, hosts

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        headers = {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in scope.get("headers", ())}
        refusal = None
        host = headers.get("host")
        if not self.hosts.allows(host):
            refusal = ApiError(400, f"Host {host!r} is not served here (a DNS-rebinding guard); name this server by "
                                    f"one of its addresses, or add the name to --allowed-hosts")
        elif scope["method"] == "POST":
            media_type = headers.get("content-type", "").split(";", 1)[0].strip().lower()
            if media_type == "multipart/form-data" and scope.get("path") == UPLOAD_PATH:
                origin = headers.get("origin")
                if origin is not None and not self.hosts.allows(urlsplit(origin).netloc or origin):
                    refusal = ApiError(403, f"an upload from the web page at {origin!r} is not served here "
                                            f"(a cross-site guard); add its host to --allowed-hosts")
            elif media_type != "application/json":
                refusal = ApiError(415, f"POST bodies must be 'Content-Type: application/json', got "
                                        f"{media_type or 'none'!r}")
        if refusal is None:
            return await self.app(scope, receive, send)
        await refusal.response()(scope, receive, send)
