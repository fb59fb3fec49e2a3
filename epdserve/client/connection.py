"""What `Client` and `AsyncClient` share: the scheduler address(es), a channel to each, the retry
policy (resume.py) and which address is current (`SchedulerConnection`)."""
from __future__ import annotations

from epdserve.client.resume import RetryPolicy
from epdserve.rpc import serve_pb2_grpc

CHANNEL_OPTIONS = [("grpc.max_send_message_length", 256 << 20), ("grpc.max_receive_message_length", 256 << 20),
                   # gRPC's reconnect backoff grows to 120 s by default: a restarted scheduler would wait that long
                   ("grpc.initial_reconnect_backoff_ms", 100), ("grpc.min_reconnect_backoff_ms", 100),
                   ("grpc.max_reconnect_backoff_ms", 1000)]


def addresses_of(address) -> list[str]:
    """One "host:port", or several (a list, or one string with commas)."""
    out = [a.strip() for a in address.split(",")] if isinstance(address, str) else [str(a) for a in address]
    out = [a for a in out if a]
    if not out:
        raise ValueError("no scheduler address given")
    return out


class SchedulerConnection:
    """What `Client` and `AsyncClient` share: the scheduler address(es), one channel to each (made
    by `make_channel`: sync or asyncio), the retry policy and which address is current."""

    def __init__(self, address, timeout, api_key, tls_ca, tls, retries, retry_backoff_s, make_channel):
        from epdserve.security import channels

        self.addresses = addresses_of(address)
        self.timeout = timeout
        self.retry = RetryPolicy(retries, retry_backoff_s, max(retry_backoff_s, RetryPolicy.max_backoff_s))
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
