"""The launcher picks the scheduler's internal port itself (`Deployment._registry`), so another
process can take it before the scheduler binds it (seen in a benchmark run: an outgoing
connection's ephemeral port). Here a real socket holds the picked port: the launcher picks another
and the real scheduler process comes up on it; a taken port the operator chose is not retried."""
from __future__ import annotations

import socket
import time

import grpc
import pytest

from epdserve.deploy.deployment import Deployment, DeploymentSpec, LaunchError

pytestmark = pytest.mark.slow  # a scheduler process starts (and, below, fails to) on the tiny model


def _hold(address: str) -> socket.socket:
    host, port = address.rsplit(":", 1)
    s = socket.socket()
    s.bind((host, int(port)))
    s.listen()
    return s


def test_a_taken_internal_port_is_picked_again(qwen2_vl_tiny, tmp_path):
    dep = Deployment(DeploymentSpec(mode="monolithic", model=str(qwen2_vl_tiny), log_dir=str(tmp_path)))
    picked = dep.registry
    held = _hold(picked)
    try:
        address = dep._start_scheduler(time.monotonic() + 120, lambda: False)
        assert dep.registry != picked and "--internal-port" in dep._registry_args
        assert dep._registry_args[dep._registry_args.index("--internal-port") + 1] == dep.registry.rsplit(":", 1)[1]
        with grpc.insecure_channel(address) as ch:
            grpc.channel_ready_future(ch).result(timeout=30)  # the scheduler serves
        assert "was taken" not in (tmp_path / "scheduler.log").read_text()  # the launcher logs it, not the child
    finally:
        held.close()
        dep.stop()


def test_a_taken_port_the_operator_chose_fails_the_launch(qwen2_vl_tiny, tmp_path):
    dep = Deployment(DeploymentSpec(mode="monolithic", model=str(qwen2_vl_tiny), log_dir=str(tmp_path)))
    held = _hold(dep.registry)
    dep.spec.registry = dep.registry  # as if given: --scheduler-args with its --internal-port
    try:
        with pytest.raises(LaunchError, match="in use"):
            dep._start_scheduler(time.monotonic() + 120, lambda: False)
    finally:
        held.close()
        dep.stop()
