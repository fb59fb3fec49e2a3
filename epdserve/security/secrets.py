"""`Secret`: an API key or cluster token that compares in constant time and never prints.

Sources, first found wins: an explicit value (a flag), a file, the environment
(`EPDSERVE_API_KEY`, `EPDSERVE_CLUSTER_TOKEN`). A `launch` passes its environment to every
child, so one variable gives a whole deployment one token.
"""
from __future__ import annotations

import hmac
import os
from pathlib import Path

API_KEY_ENV = "EPDSERVE_API_KEY"
CLUSTER_TOKEN_ENV = "EPDSERVE_CLUSTER_TOKEN"
CLUSTER_TOKEN_HEADER = "epdserve-cluster-token"
AUTHORIZATION = "authorization"


class Secret:
    def __init__(self, value: str):
        if not value or not value.strip():
            raise ValueError("an empty key or token")
        self._value = value.strip()

    def matches(self, presented: str | None) -> bool:
        return presented is not None and hmac.compare_digest(presented.encode(), self._value.encode())

    def reveal(self) -> str:
        """The value itself, to send (metadata, headers); never log it."""
        return self._value

    def __repr__(self) -> str:
        return "Secret(***)"

    __str__ = __repr__

    @classmethod
    def load(cls, value: str | None = None, file: str | Path | None = None, env: str | None = None) -> Secret | None:
        if value:
            return cls(value)
        if file:
            text = Path(file).read_text()
            if not text.strip():
                raise ValueError(f"{file}: empty key or token file")
            return cls(text)
        if env and os.environ.get(env):
            return cls(os.environ[env])
        return None


def bearer(authorization: str | None) -> str | None:
    """The token of an ``authorization: Bearer <token>`` value, or None."""
    if not authorization:
        return None
    scheme, _, token = authorization.partition(" ")
    return token.strip() if scheme.lower() == "bearer" else None
