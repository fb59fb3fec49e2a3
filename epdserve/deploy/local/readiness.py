"""The launcher's readiness probe: is every instance on the scheduler's roster and HEALTHY?

`RosterProbe` calls the scheduler's public `GetServerInfo` with the credentials the deployment
hands out — TLS when public TLS is on (trusting the certificates of the scheduler's --tls-cert:
self-signed, or a chain file ending with its CA), and the API key / cluster token from the
environment — and remembers what it saw: the instances registered and their health, and the
last error the scheduler answered with (UNAVAILABLE while it starts, UNAUTHENTICATED for a wrong
key, a TLS handshake failure ...). `report()` says both, for the launcher's timeout message.
"""
from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field


@dataclass
class RosterProbe:
    address: str  # the scheduler's public host:port
    want: int  # instances that must be HEALTHY
    tls_ca: str | None = None  # PEM roots to trust (the scheduler's --tls-cert); None: plaintext
    cluster_token: str | None = None  # the deployment's (default: EPDSERVE_CLUSTER_TOKEN)
    last_error: str = ""  # the last failed call: "<STATUS>: <details>"
    roster: list[tuple[str, str]] = field(default_factory=list)  # (roles, health) of the last good answer
    answered: bool = False  # the scheduler answered at least once

    def channel(self):
        from epdserve.security import channels

        key, token = channels.from_env(cluster_token=self.cluster_token)  # the deployment's API key / cluster token
        return channels.channel(self.address, api_key=key, cluster_token=token, tls_ca=self.tls_ca)

    def poll(self, stub, timeout_s: float = 2.0) -> bool:
        """One GetServerInfo call on `stub` (an EPDServeStub): are `want` instances HEALTHY?"""
        import grpc

        from epdserve.rpc import common_pb2, serve_pb2

        try:
            info = stub.GetServerInfo(serve_pb2.GetServerInfoRequest(), timeout=timeout_s)
        except grpc.RpcError as e:
            code = e.code().name if e.code() is not None else "UNKNOWN"
            self.last_error = f"{code}: {e.details() or ''}".strip()
            return False
        self.answered = True
        self.roster = [(i.roles or "?", common_pb2.HealthState.Name(i.health)) for i in info.instances]
        return sum(1 for _, health in self.roster if health == "HEALTHY") >= self.want

    def report(self) -> str:
        """What the probe saw: the roster (or that the scheduler never answered) and its last error."""
        if self.answered:
            healthy = sum(1 for _, h in self.roster if h == "HEALTHY")
            counts = Counter(f"{roles} {health}" for roles, health in self.roster)
            listing = ", ".join(f"{n}x {what}" if n > 1 else what for what, n in sorted(counts.items()))
            seen = (f"{len(self.roster)} of {self.want} instances registered, {healthy} HEALTHY"
                    + (f" ({listing})" if listing else ""))
        else:
            seen = f"the scheduler at {self.address} never answered the probe"
        if self.last_error:
            seen += f"; last error from the scheduler: {self.last_error}"
            if "UNAUTHENTICATED" in self.last_error:
                seen += " (the probe sends EPDSERVE_API_KEY / EPDSERVE_CLUSTER_TOKEN from the launcher's environment)"
            elif not self.answered and self.tls_ca is None:
                seen += " (the probe spoke plaintext: is the scheduler's port TLS? pass --tls-cert/--tls-key to launch)"
        return seen
