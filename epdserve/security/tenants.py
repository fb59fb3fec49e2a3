"""Tenants: who a caller is, named by the API key it presents, and the cache salt of its requests.

`TenantKeys` holds every client key of a deployment: today's single key (``--api-key-file``,
``EPDSERVE_API_KEY``; its holders are the default tenant, ``""``) and a keys file
(``--api-keys-file``), one ``<tenant> <key>`` per line (``#`` comments and blank lines skipped;
a tenant name is ``[A-Za-z0-9._-]+``; one tenant may hold several keys, one key names one tenant).
A line ``@weight <tenant> <w>`` gives a tenant its weight (a number > 0, default 1): its share of
every engine's slots when tenants compete (engine/fair_share.py); ``@`` starts no tenant name.
`reload()` re-reads the file (the scheduler does on SIGHUP); a file that no longer parses keeps
the keys in use and says why. Presented keys are looked up by their SHA-256, never compared
byte by byte; nothing here prints a key.

`cache_salt(tenant, salt)`: what one request's cached prefixes are keyed under (the first KV
block's hash, its media keys, the router's prompt-chunk index): the tenant and the request's own
`cache_salt` (vLLM's field), length-prefixed so that no tenant can name another's salt; empty
for the default tenant without a salt, so a single-tenant deployment keys everything as before.
"""
from __future__ import annotations

import hashlib
import logging
import re
import threading
from pathlib import Path

from epdserve.security.secrets import Secret

log = logging.getLogger(__name__)

DEFAULT_TENANT = ""  # the single key's holders, the cluster token's, and everyone where no key is set
_NAME = re.compile(r"^[A-Za-z0-9._-]+$")


class KeysFileError(ValueError):
    """A keys file that does not parse (the message names the file and line, never a key)."""


def _digest(key: str) -> bytes:
    return hashlib.sha256(key.strip().encode()).digest()


def parse_keys_file(path: str | Path) -> dict[bytes, str]:
    """SHA-256 of each key -> its tenant, from `path`; KeysFileError when a line is not ``<tenant> <key>``."""
    return _parse(path)[0]


def _weight_line(path, n: int, text: str) -> tuple[str, float]:
    parts = text.split()
    try:
        if len(parts) != 3 or not _NAME.match(parts[1]) or not float(parts[2]) > 0 or float(parts[2]) == float("inf"):
            raise ValueError
        return parts[1], float(parts[2])
    except ValueError:
        raise KeysFileError(f"{path}:{n}: expected '@weight <tenant> <number > 0>'") from None


def _parse(path: str | Path) -> tuple[dict[bytes, str], dict[str, float]]:
    """(SHA-256 of each key -> its tenant, tenant -> its weight where a line sets one)."""
    out: dict[bytes, str] = {}
    weights: dict[str, float] = {}
    for n, line in enumerate(Path(path).read_text().splitlines(), 1):
        text = line.strip()
        if not text or text.startswith("#"):
            continue
        if text.startswith("@weight"):
            tenant, w = _weight_line(path, n, text)
            weights[tenant] = w
            continue
        tenant, _, key = text.partition(" ")
        key = key.strip()
        if not _NAME.match(tenant) or not key:
            raise KeysFileError(f"{path}:{n}: expected '<tenant> <key>' with a tenant of letters, digits, '.', '_' "
                                f"or '-'")
        d = _digest(key)
        if d in out and out[d] != tenant:
            raise KeysFileError(f"{path}:{n}: this key already names tenant {out[d]!r}")
        out[d] = tenant
    if not out:
        raise KeysFileError(f"{path}: no keys")
    unknown = sorted(set(weights) - set(out.values()))
    if unknown:
        raise KeysFileError(f"{path}: @weight for tenants that hold no key: {', '.join(unknown)}")
    return out, weights


class TenantKeys:
    """Every client key and the tenant it names. `single`: today's one key (the default tenant);
    `file`: a keys file. Thread-safe: the HTTP front and gRPC share one, SIGHUP reloads it."""

    def __init__(self, single: Secret | None = None, file: str | Path | None = None):
        self.file = Path(file) if file else None
        self._single = _digest(single.reveal()) if single is not None else None
        self._lock = threading.Lock()
        self._keys, self._weights = self._load()

    def _load(self) -> tuple[dict[bytes, str], dict[str, float]]:
        keys, weights = _parse(self.file) if self.file is not None else ({}, {})
        if self._single is not None:
            keys[self._single] = DEFAULT_TENANT
        return keys, weights

    def reload(self) -> bool:
        """Re-read the keys file; on an error keep the keys in use (logged). True when reloaded."""
        try:
            keys, weights = self._load()
        except (OSError, KeysFileError) as e:
            log.error("keys file not reloaded, the keys in use stay: %s", e)
            return False
        with self._lock:
            self._keys, self._weights = keys, weights
        log.info("keys file %s reloaded: %d keys, %d tenants", self.file, len(keys), len(set(keys.values())))
        return True

    def tenant_of(self, presented: str | None) -> str | None:
        """The tenant `presented` names, or None (no such key)."""
        if not presented or not presented.strip():
            return None
        with self._lock:
            return self._keys.get(_digest(presented))

    def weight(self, tenant: str) -> float:
        """The tenant's weight (the keys file's ``@weight``; 1 by default)."""
        with self._lock:
            return self._weights.get(tenant, 1.0)

    def matches(self, presented: str | None) -> bool:  # a Secret's interface: `interceptors.Rule` accepts it
        return self.tenant_of(presented) is not None

    def tenants(self) -> set[str]:
        with self._lock:
            return set(self._keys.values())

    def __repr__(self) -> str:
        return f"TenantKeys({len(self._keys)} keys, file={self.file})"


def client_keys(single: Secret | None, file: str | Path | None) -> TenantKeys | None:
    """The deployment's `TenantKeys`, or None when it has no client key at all."""
    return TenantKeys(single, file) if single is not None or file else None


def cache_salt(tenant: str, salt: str = "") -> str:
    """What a request's cached prefixes are keyed under: "" for the default tenant without a salt
    (everything as before tenants), else the tenant and the salt, length-prefixed."""
    if not tenant and not salt:
        return ""
    return f"{len(tenant)}:{tenant}|{salt}"
