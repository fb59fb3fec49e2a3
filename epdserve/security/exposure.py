"""Who can reach a listener, and the refusal to open one beyond loopback without a credential.

`is_loopback(host)`: True when every address `host` binds resolves to a loopback address
(``127.0.0.1``, ``localhost``, ``::1``); ``0.0.0.0``, ``::`` and the empty host (every
interface) are not. `guard(what, host, protected, fix, insecure)`: the rule every listener of a
deployment follows, as Redis's protected mode does — a listener beyond loopback must refuse an
unauthenticated caller (`protected`); otherwise starting raises `ExposureError`, one line naming
the listener and the fix, unless the operator passed ``--insecure`` (a lab), which logs a
warning on every start instead.
"""
from __future__ import annotations

import ipaddress
import logging
import socket

log = logging.getLogger(__name__)

INSECURE_HELP = ("start even when a port beyond loopback would serve unauthenticated callers (a lab on a "
                 "trusted network; a warning is logged on every start); default: refuse, saying which credential "
                 "is missing")


class ExposureError(ValueError):
    """A listener would serve unauthenticated callers beyond loopback."""


def is_loopback(host: str | None) -> bool:
    if host is None:
        return True  # the callers' default: 127.0.0.1
    name = host.strip("[]")
    if name in ("", "0.0.0.0", "::", "*"):
        return False
    try:
        return ipaddress.ip_address(name).is_loopback
    except ValueError:
        pass
    try:
        infos = socket.getaddrinfo(name, None)
    except OSError:
        return False  # unknown: treat as reachable
    return bool(infos) and all(ipaddress.ip_address(i[4][0].split("%")[0]).is_loopback for i in infos)


def guard(what: str, host: str | None, protected: bool, fix: str, insecure: bool = False) -> None:
    """Refuse (ExposureError) `what` bound on `host` beyond loopback when not `protected`,
    unless `insecure`; `fix`: what makes it protected ("set EPDSERVE_API_KEY")."""
    if protected or is_loopback(host):
        return
    if insecure:
        log.warning("insecure: %s on %s serves unauthenticated callers beyond loopback (--insecure); %s",
                    what, host, fix)
        return
    raise ExposureError(f"refusing to serve {what} on {host} to unauthenticated callers: {fix}, bind it to "
                        f"127.0.0.1, or pass --insecure (a trusted lab network)")
