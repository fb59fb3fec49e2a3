"""Which hosts and addresses a remote media fetch may reach (the SSRF policy, no networking here).

`address_refusal(ip)`: why a resolved address is off limits (loopback, private, link-local,
multicast, reserved, unspecified, site-local, carrier-grade NAT, IPv4-mapped or -compatible IPv6,
NAT64 of a non-global IPv4, cloud metadata), or None for a global address.
`MediaDomains`: the operator's ``--allowed-media-domains`` list. Unset, any host whose every
address is global may be fetched. Set (as vLLM's flag of the same name), only the hosts it names
may be fetched, and the operator vouches for them: they may resolve to internal addresses (an
image server on the cluster network, ``localhost`` in a lab) — but never to a cloud metadata
address. An entry matches a URL's host exactly (``images.example.com``, ``127.0.0.1``, ``::1``);
an entry with a leading dot matches every name under it (``.example.com``: ``a.example.com``,
``b.c.example.com``, not ``example.com`` itself).
"""
from __future__ import annotations

import ipaddress
import re
from dataclasses import dataclass

# instance-metadata services: AWS (v4, v6, ECS task), GCP/Azure/OpenStack/DigitalOcean (the v4
# link-local one), Alibaba Cloud, Oracle Cloud; refused even for an allow-listed host (`is_metadata`)
METADATA = frozenset(ipaddress.ip_address(a) for a in (
    "169.254.169.254", "fd00:ec2::254", "169.254.170.2", "169.254.170.23", "fd00:ec2::23",
    "100.100.100.200", "192.0.0.192"))
_CGNAT = ipaddress.ip_network("100.64.0.0/10")
_SITE_LOCAL = ipaddress.ip_network("fec0::/10")
_NAT64 = (ipaddress.ip_network("64:ff9b::/96"), ipaddress.ip_network("64:ff9b:1::/48"))
_HOST_NAME = re.compile(r"[a-z0-9_]([a-z0-9_-]*[a-z0-9_])?(\.[a-z0-9_]([a-z0-9_-]*[a-z0-9_])?)*")
_KINDS = ("unspecified", "loopback", "link_local", "multicast", "reserved", "private")  # most specific first


def is_metadata(ip: ipaddress.IPv4Address | ipaddress.IPv6Address) -> bool:
    """Whether `ip` is a cloud metadata address, or an IPv6 address carrying one (refused even for
    an allow-listed host)."""
    return ip in METADATA or (ip.version == 6 and _carried_ipv4(ip) in METADATA)


def address_refusal(ip: ipaddress.IPv4Address | ipaddress.IPv6Address) -> str | None:
    """Why `ip` may not be fetched from ("a loopback address", ...), or None when it is global."""
    if is_metadata(ip):
        return "a cloud metadata address"
    if ip.version == 6:
        embedded = _carried_ipv4(ip)
        if embedded is not None and (not _is_nat64(ip) or address_refusal(embedded)):
            return f"an IPv6 address embedding the IPv4 address {embedded}"
        if ip in _SITE_LOCAL:
            return "a site-local address"
    for kind in _KINDS:
        if getattr(ip, f"is_{kind}"):
            return f"a {kind.replace('_', '-')} address"
    if ip.version == 4 and ip in _CGNAT:
        return "a carrier-grade NAT address"
    if not ip.is_global:
        return "not a global address"
    return None


def _carried_ipv4(ip: ipaddress.IPv6Address) -> ipaddress.IPv4Address | None:
    """The IPv4 address an IPv4-mapped (::ffff:a.b.c.d), -compatible (::a.b.c.d) or NAT64 IPv6
    address carries. A mapped or compatible one is refused whatever it carries (no public DNS name
    resolves to one), a NAT64 one when what it carries is."""
    if ip.ipv4_mapped is not None:
        return ip.ipv4_mapped
    if (ip.packed[:12] == bytes(12) and int(ip) > 1) or _is_nat64(ip):  # :: and ::1 are classified below
        return ipaddress.IPv4Address(ip.packed[12:])
    return None


def _is_nat64(ip: ipaddress.IPv6Address) -> bool:
    return any(ip in net for net in _NAT64)


def normal_host(host: str) -> str:
    """A host as allow-list entries are compared: lower case, no brackets, no trailing dot."""
    return host.strip().strip("[]").rstrip(".").lower()


@dataclass(frozen=True)
class MediaDomains:
    """The allow-list (empty: any host with only global addresses). Entries are validated and
    normalised on construction; `parse("a.com, .b.org")` reads the flag's comma-separated form."""

    entries: tuple[str, ...] = ()

    def __post_init__(self):
        norm = []
        for raw in self.entries:
            entry = normal_host(raw)
            name = entry[1:] if entry.startswith(".") else entry
            if not (_is_ip(name) or _HOST_NAME.fullmatch(name)):
                raise ValueError(f"--allowed-media-domains: {raw!r} is not a host name; write names such as "
                                 "images.example.com, .example.com (every name under it) or 127.0.0.1, "
                                 "comma-separated, without scheme, port or wildcard")
            norm.append(entry)
        object.__setattr__(self, "entries", tuple(dict.fromkeys(norm)))

    @classmethod
    def parse(cls, text: str | None) -> MediaDomains:
        return cls(tuple(p for p in (text or "").split(",") if p.strip()))

    def __bool__(self) -> bool:
        return bool(self.entries)

    def allows(self, host: str) -> bool:
        """Whether `host` (a URL's host name) is named by an entry (False when the list is empty)."""
        host = normal_host(host)
        return any(host == e or (e.startswith(".") and host.endswith(e)) for e in self.entries)

    def __str__(self) -> str:
        return ",".join(self.entries)


def _is_ip(text: str) -> bool:
    try:
        ipaddress.ip_address(text)
        return True
    except ValueError:
        return False
