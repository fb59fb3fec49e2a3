"""The scheduler's internal port (where instances register), when the launcher owns it: the
scheduler binds a free one itself (port 0), so no other process can take it between a pick and
the bind (seen in a benchmark run when the launcher picked it in advance); the launcher reads it
back for the instances and a restarted scheduler comes back on it. A taken port the operator
chose fails the launch. Real scheduler processes on the tiny model, real sockets."""
from __future__ import annotations

import socket
import time

import grpc
import pytest

from epdserve.deploy.local.deployment import Deployment, DeploymentSpec, LaunchError

pytestmark = pytest.mark.slow  # scheduler processes start (and, below, fail to) on the tiny model


def _ready(address: str) -> None:
    with grpc.insecure_channel(address) as ch:
        grpc.channel_ready_future(ch).result(timeout=30)


def test_the_internal_port_is_the_schedulers_own_and_survives_a_restart(qwen2_vl_tiny, tmp_path):
    dep = Deployment(DeploymentSpec(mode="monolithic", model=str(qwen2_vl_tiny), log_dir=str(tmp_path)))
    assert dep.registry == ""  # not picked in advance
    try:
        address = dep.address = dep._start_scheduler(time.monotonic() + 120, lambda: False)  # as start() does
        registry = dep.registry
        assert registry == (tmp_path / "scheduler.internal").read_text().strip() and registry != address
        assert f"--scheduler {registry}" in " ".join(dep._instance_argv("EPD"))
        _ready(registry)
        dep.scheduler.stop(5.0)
        dep._restart_scheduler()
        while not (tmp_path / "scheduler.address").exists():
            time.sleep(0.1)
        _ready(registry)  # back on the same internal port
        assert dep.registry == registry
    finally:
        dep.stop()


def test_a_taken_port_the_operator_chose_fails_the_launch(qwen2_vl_tiny, tmp_path):
    held = socket.socket()
    held.bind(("127.0.0.1", 0))
    held.listen()
    chosen = f"127.0.0.1:{held.getsockname()[1]}"
    dep = Deployment(DeploymentSpec(mode="monolithic", model=str(qwen2_vl_tiny), log_dir=str(tmp_path), registry=chosen,
                                    scheduler_args=["--internal-port", chosen.rsplit(":", 1)[1]]))
    try:
        with pytest.raises(LaunchError, match="in use"):
            dep._start_scheduler(time.monotonic() + 120, lambda: False)
    finally:
        held.close()
        dep.stop()
