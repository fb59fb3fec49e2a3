"""The scheduler as a real process (`epdserve scheduler`) and instances joining through the
Registry service (Register / Heartbeat / Deregister over gRPC)."""
import os
import signal
import subprocess
import sys

import grpc
import pytest

from epdserve import Client
from epdserve.client import EPDServeError
from epdserve.rpc import common_pb2, instance_pb2, instance_pb2_grpc
from tests.scheduler.harness import PH, image, start_scheduler, wait_until


@pytest.fixture(scope="module")
def instance(two_instances):
    return two_instances[0]


def test_scheduler_process_serves_and_stops_on_sigterm(qwen2_vl_tiny, instance, tmp_path):
    addr_file = tmp_path / "addr"
    proc = subprocess.Popen(
        [sys.executable, "-m", "epdserve.entrypoints.scheduler_cli", "--model", str(qwen2_vl_tiny),
         "--instance", instance.address, "--address-file", str(addr_file), "--probe-interval", "0.2"],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, cwd=os.getcwd(),
    )
    try:
        wait_until(lambda: addr_file.exists() or proc.poll() is not None, 120, "the scheduler to serve")
        assert proc.poll() is None, proc.stdout.read()
        address = addr_file.read_text()
        with Client(address, timeout=60) as c:
            wait_until(lambda: c.server_info().instances, 30, "the static instance")
            out = c.generate(f"Process {PH}", images=[image(4)], max_tokens=4)
            assert out.usage.output_tokens == 4 and c.health() == "SERVING"
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(30) == 0
        assert "epdserve scheduler ready: " in proc.stdout.read()
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def test_instances_register_heartbeat_and_deregister(qwen2_vl_tiny, instance):
    sched = start_scheduler(qwen2_vl_tiny, [])
    try:
        # one quick retry on UNAVAILABLE (the default policy backs off ~23 s): the scheduler's answer is tested here
        with grpc.insecure_channel(sched.server.internal_address) as ch, \
                Client(sched.address, timeout=60, retries=1, retry_backoff_s=0.05) as c:
            reg = instance_pb2_grpc.RegistryStub(ch)
            resp = reg.Register(instance_pb2.RegisterRequest(instance=instance.status()))
            assert resp.scheduler_id == sched.server.scheduler_id and resp.heartbeat_interval_s > 0
            assert reg.Heartbeat(instance_pb2.HeartbeatRequest(instance_id=instance.instance_id,
                                                               load=common_pb2.Load(running_requests=1))).known
            assert c.generate("registered", max_tokens=2).usage.output_tokens == 2
            other = instance.status()
            other.instance_id, other.media_namespace = "impostor", "another-model@0"
            with pytest.raises(grpc.RpcError) as e:
                reg.Register(instance_pb2.RegisterRequest(instance=other))
            assert e.value.code() == grpc.StatusCode.FAILED_PRECONDITION
            reg.Deregister(instance_pb2.DeregisterRequest(instance_id=instance.instance_id))
            assert not reg.Heartbeat(instance_pb2.HeartbeatRequest(instance_id=instance.instance_id)).known
            with pytest.raises(EPDServeError) as e:
                c.generate("nobody home", max_tokens=2)
            assert e.value.code == grpc.StatusCode.UNAVAILABLE
    finally:
        sched.stop()
