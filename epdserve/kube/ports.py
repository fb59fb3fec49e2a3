"""The ports a Kubernetes deployment of epdserve names: the one place they are written down.

Processes take every port as a flag (`--port`, `--internal-port`, `--http-port`); a manifest must
name its container ports, and every object that refers to one (container, Service, probe,
NetworkPolicy, ServiceMonitor, the instances' `--scheduler` list) reads it from `Ports`.
"""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Ports:
    scheduler: int = 50051  # public gRPC (EPDServe): clients, with the API key
    internal: int = 50052  # the scheduler's Registry: instances, with the cluster token
    http: int = 8000  # the OpenAI-compatible front and /metrics (API key)
    instance: int = 50061  # an instance's gRPC (Instance, KvStore): the scheduler and peer instances
    mm_store: int = 6379  # the try-out Redis of the MM Store
    hccl_host_range: str = "60000-60099"  # HCCL_HOST_SOCKET_PORT_RANGE (Ascend P-D pairs), as scripts/atlas_node.sh

    def __post_init__(self):
        for name in ("scheduler", "internal", "http", "instance", "mm_store"):
            value = getattr(self, name)
            if not 0 < value < 65536:
                raise ValueError(f"port {name} must be 1..65535, got {value}")
        named = [self.scheduler, self.internal, self.http, self.instance]
        if len(set(named)) != len(named):
            raise ValueError(f"the scheduler, internal, http and instance ports must differ, got {named}")
