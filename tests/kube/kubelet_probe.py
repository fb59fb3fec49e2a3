"""A container's probes as the kubelet sends them: grpc.health.v1 Check on the probe's port and
service, or a TCP connect, to the pod IP, within the probe's timeoutSeconds."""
from __future__ import annotations

import socket

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

PROBES = ("startupProbe", "readinessProbe", "livenessProbe")


def probe_port(c: dict, kind: str = "readinessProbe") -> int:
    spec = c[kind]
    return spec["grpc"]["port"] if "grpc" in spec else spec["tcpSocket"]["port"]


def probe(c: dict, ip: str, kind: str = "readinessProbe") -> bool:
    """One probe of the container's (`kind`: its startup, readiness or liveness probe) as the
    kubelet sends it to the pod IP: grpc.health.v1 Check (the probe's `service`, default "")
    answering SERVING, or a TCP connect; within the probe's timeoutSeconds."""
    spec = c[kind]
    timeout = spec.get("timeoutSeconds", 1)
    if "tcpSocket" in spec:
        with socket.socket() as s:
            s.settimeout(timeout)
            return s.connect_ex((ip, spec["tcpSocket"]["port"])) == 0
    with grpc.insecure_channel(f"{ip}:{spec['grpc']['port']}") as ch:
        try:
            resp = health_pb2_grpc.HealthStub(ch).Check(
                health_pb2.HealthCheckRequest(service=spec["grpc"].get("service", "")), timeout=timeout)
        except grpc.RpcError:
            return False
    return resp.status == health_pb2.HealthCheckResponse.SERVING
