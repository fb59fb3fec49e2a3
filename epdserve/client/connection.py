"""What `Client` and `AsyncClient` share: the scheduler target(s), a channel to each, the retry
policy (resume.py) and which target is current (`SchedulerConnection`).

A target is what gRPC dials (https://github.com/grpc/grpc/blob/master/doc/naming.md): "host:port",
or a URI naming a resolver — "dns:///scheduler.ns.svc:50051" (every address the name resolves
to, as a Kubernetes headless Service gives one per scheduler pod), "ipv4:10.0.0.1:50051,10.0.0.2:50051".
Every channel balances its calls over the addresses its target resolves to with gRPC's
`round_robin` policy, which sends calls only to addresses that are connected, and re-resolves
DNS at most once a second after a connection drops (gRPC's default waits 30 s), so a scheduler
pod that is replaced under a new IP is found. A ClusterIP Service is one address: kube-proxy
spreads the connections, and a retry after a lost scheduler reconnects through it. Several
targets (a list, or "host:a,host:b") get a channel each; a retry moves to the next.
"""
from __future__ import annotations

from epdserve.client.resume import RetryPolicy
from epdserve.rpc import serve_pb2_grpc

CHANNEL_OPTIONS = [("grpc.max_send_message_length", 256 << 20), ("grpc.max_receive_message_length", 256 << 20),
                   # gRPC's reconnect backoff grows to 120 s by default: a restarted scheduler would wait that long
                   ("grpc.initial_reconnect_backoff_ms", 100), ("grpc.min_reconnect_backoff_ms", 100),
                   ("grpc.max_reconnect_backoff_ms", 1000),
                   ("grpc.lb_policy_name", "round_robin"), ("grpc.dns_min_time_between_resolutions_ms", 1000)]

# gRPC's resolver schemes: a target that starts with one is one target, commas and all.
RESOLVER_SCHEMES = ("dns", "ipv4", "ipv6", "unix", "unix-abstract", "vsock", "xds")


def addresses_of(address) -> list[str]:
    """The targets: one "host:port" or resolver URI, or several (a list, or one string of
    "host:port"s with commas)."""
    if isinstance(address, str):
        out = [address.strip()] if address.split(":", 1)[0] in RESOLVER_SCHEMES else address.split(",")
    else:
        out = [str(a) for a in address]
    out = [a.strip() for a in out if a.strip()]
    if not out:
        raise ValueError("no scheduler address given")
    return out


class SchedulerConnection:
    """What `Client` and `AsyncClient` share: the scheduler target(s), one channel to each (made
    by `make_channel`: sync or asyncio), the retry policy and which target is current."""

    def __init__(self, address, timeout, api_key, tls_ca, tls, retry: RetryPolicy, make_channel):
        from epdserve.security import channels

        self.addresses = addresses_of(address)
        self.timeout = timeout
        self.retry = retry
        self.retried = 0  # generations resumed after a lost scheduler, in all
        key, token = channels.from_env(api_key)
        self._channels = [make_channel(a, CHANNEL_OPTIONS, api_key=key, cluster_token=token, tls_ca=tls_ca, tls=tls)
                          for a in self.addresses]
        self._current = 0

    @property
    def address(self) -> str:
        return self.addresses[self._current]

    @property
    def _channel(self):
        return self._channels[self._current]

    @property
    def _stub(self) -> serve_pb2_grpc.EPDServeStub:
        return serve_pb2_grpc.EPDServeStub(self._channel)

    def _next(self) -> None:
        """Move to the next target (the same one when there is one)."""
        self._current = (self._current + 1) % len(self.addresses)
        self.retried += 1


def retry_policy(retry_deadline_s, retry_backoff_s, retry_max_backoff_s, retries) -> RetryPolicy:
    """The clients' keyword arguments as a `RetryPolicy` (a backoff above the default cap raises the cap)."""
    return RetryPolicy(retry_deadline_s, retry_backoff_s, max(retry_backoff_s, retry_max_backoff_s), retries)
