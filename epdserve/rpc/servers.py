"""gRPC server plumbing shared by the scheduler and instance processes.

- `add_health_and_reflection(server, services)`: grpc.health.v1 (overall "" and each service
  SERVING) and server reflection listing `services` plus the health and reflection services;
  returns the health servicer so the owner can flip statuses (e.g. NOT_SERVING while draining).
  Works for both `grpc.server` and `grpc.aio.server`.
- `set_serving(servicer, services, serving)` / `set_serving_aio`: flip those statuses.
- `free_port()`: re-exported from `epdserve.net` (where it lives) for the gRPC side's callers.
"""
from __future__ import annotations

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from epdserve.net import free_port

__all__ = ["HEALTH_SERVICE", "add_health_and_reflection", "free_port", "set_serving", "set_serving_aio"]

HEALTH_SERVICE = health_pb2.DESCRIPTOR.services_by_name["Health"].full_name  # "grpc.health.v1.Health"


def add_health_and_reflection(server, services: list[str], aio: bool | None = None):
    """Register health checking and reflection on `server` for `services` (full names)."""
    if aio is None:
        aio = isinstance(server, grpc.aio.Server)
    servicer = health.aio.HealthServicer() if aio else health.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(servicer, server)
    names = list(services) + [HEALTH_SERVICE, reflection.SERVICE_NAME]
    reflection.enable_server_reflection(names, server)
    return servicer


async def set_serving_aio(servicer, services: list[str], serving: bool = True) -> None:
    status = health_pb2.HealthCheckResponse.SERVING if serving else health_pb2.HealthCheckResponse.NOT_SERVING
    for name in ["", *services]:
        await servicer.set(name, status)


def set_serving(servicer, services: list[str], serving: bool = True) -> None:
    status = health_pb2.HealthCheckResponse.SERVING if serving else health_pb2.HealthCheckResponse.NOT_SERVING
    for name in ["", *services]:
        servicer.set(name, status)
