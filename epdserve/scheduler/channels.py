"""One grpc.aio channel per instance address, with the stubs the scheduler uses on it.

Channels are created on first use and closed when their instance is forgotten or the
scheduler stops. Lives on the scheduler's event loop (no locks).
"""
from __future__ import annotations

from dataclasses import dataclass

import grpc
from grpc_health.v1 import health_pb2_grpc

from epdserve.rpc import instance_pb2_grpc

# Large media and long prompts: allow messages well past gRPC's 4 MB default.
CHANNEL_OPTIONS = [
    ("grpc.max_send_message_length", 256 << 20),
    ("grpc.max_receive_message_length", 256 << 20),
    ("grpc.keepalive_time_ms", 10_000),
    ("grpc.keepalive_timeout_ms", 5_000),
    ("grpc.keepalive_permit_without_calls", 1),
]


@dataclass
class InstanceChannel:
    address: str
    channel: grpc.aio.Channel
    instance: instance_pb2_grpc.InstanceStub
    health: health_pb2_grpc.HealthStub


class ChannelPool:
    """`interceptors`: grpc.aio client interceptors of every channel (the cluster token's);
    `credentials`: channel credentials for instances serving TLS (mutual TLS), else plaintext."""

    def __init__(self, interceptors=None, credentials=None):
        self._channels: dict[str, InstanceChannel] = {}
        self._interceptors = interceptors
        self._credentials = credentials

    def get(self, address: str) -> InstanceChannel:
        ch = self._channels.get(address)
        if ch is None:
            if self._credentials is not None:
                channel = grpc.aio.secure_channel(address, self._credentials, options=CHANNEL_OPTIONS,
                                                  interceptors=self._interceptors)
            else:
                channel = grpc.aio.insecure_channel(address, options=CHANNEL_OPTIONS, interceptors=self._interceptors)
            ch = InstanceChannel(address, channel, instance_pb2_grpc.InstanceStub(channel),
                                 health_pb2_grpc.HealthStub(channel))
            self._channels[address] = ch
        return ch

    def addresses(self) -> list[str]:
        return list(self._channels)

    async def drop(self, address: str) -> None:
        ch = self._channels.pop(address, None)
        if ch is not None:
            await ch.channel.close()

    async def close(self) -> None:
        for address in list(self._channels):
            await self.drop(address)
