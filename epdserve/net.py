"""Local networking helpers with no dependency on gRPC or torch: `free_port`.

Owns the one way epdserve picks a port nobody configured (tests, launchers, the private MM Store
server); config decides every other port.
"""
from __future__ import annotations

import socket


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port on ``host`` free at the time of the call (another process may take it before
    the caller binds it: callers that start a server retry on another port)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return s.getsockname()[1]
