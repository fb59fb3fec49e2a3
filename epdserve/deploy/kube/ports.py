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
    # HCCL_HOST_SOCKET_PORT_RANGE for Ascend P-D pairs, e.g. "60000-60099"; None: not set. CANN documents
    # it for Atlas A3, 800T A2, 900 A2 PoD and 200T A2 Box16 only (HCCL user guide, hcclenvref_07_0020),
    # so it is set only when asked for, as scripts/atlas_node.sh does
    hccl_host_range: str | None = None

    def __post_init__(self):
        for name in ("scheduler", "internal", "http", "instance", "mm_store"):
            value = getattr(self, name)
            if not 0 < value < 65536:
                raise ValueError(f"port {name} must be 1..65535, got {value}")
        named = [self.scheduler, self.internal, self.http, self.instance]
        if len(set(named)) != len(named):
            raise ValueError(f"the scheduler, internal, http and instance ports must differ, got {named}")
