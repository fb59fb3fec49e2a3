"""Mutual TLS between scheduler and instance (a self-signed CA certificate made here, used by
both sides): the instance registers over TLS with its certificate, the scheduler calls it over
TLS with its own, requests are served; a plaintext or certificate-less client is refused."""
from __future__ import annotations

import grpc
import pytest

from epdserve import Client
from epdserve.instance.config import InstanceConfig
from epdserve.instance.host import InstanceHost
from epdserve.rpc import instance_pb2, instance_pb2_grpc
from epdserve.scheduler import SchedulerConfig, SchedulerThread
from epdserve.security import Secret
from epdserve.security.options import InstanceSecurity, SchedulerSecurity
from epdserve.security.tls import channel_credentials
from tests.instance.harness import wait_until
from tests.security.certs import self_signed

TOKEN = "mtls-cluster-token"


def test_scheduler_and_instance_over_mutual_tls(qwen2_vl_tiny, tmp_path, monkeypatch):
    monkeypatch.delenv("EPDSERVE_API_KEY", raising=False)
    monkeypatch.delenv("EPDSERVE_CLUSTER_TOKEN", raising=False)
    cert, key = self_signed(tmp_path)
    sched = SchedulerThread(SchedulerConfig(model=str(qwen2_vl_tiny), probe_interval_s=0.2), security=SchedulerSecurity(
        cluster_token=Secret(TOKEN), internal_port=0, internal_tls_cert=cert, internal_tls_key=key,
        internal_tls_ca=cert))
    sched.start()
    host = None
    try:
        host = InstanceHost(InstanceConfig(roles="PD", model=str(qwen2_vl_tiny), scheduler=sched.server.internal_address,
                                           kv_cache_bytes=2 << 20),
                            security=InstanceSecurity(Secret(TOKEN), tls_cert=cert, tls_key=key, tls_ca=cert)).start()
        assert host.wait_registered(30)
        wait_until(lambda: sched.call(sched.server.registry.records), what="registration")
        with Client(sched.address, timeout=60) as c:
            assert len(c.generate("over mutual TLS", max_tokens=3, ignore_eos=True).token_ids) == 3
        address = f"127.0.0.1:{host.port}"
        token = [("epdserve-cluster-token", TOKEN)]
        for channel in (grpc.insecure_channel(address),  # plaintext
                        grpc.secure_channel(address, channel_credentials(cert))):  # TLS, but no client certificate
            with channel:
                with pytest.raises(grpc.RpcError) as e:
                    instance_pb2_grpc.InstanceStub(channel).GetLoad(instance_pb2.GetLoadRequest(), metadata=token,
                                                                    timeout=5)
                assert e.value.code() == grpc.StatusCode.UNAVAILABLE
        with grpc.secure_channel(address, channel_credentials(cert, cert, key)) as channel:
            st = instance_pb2_grpc.InstanceStub(channel).GetLoad(instance_pb2.GetLoadRequest(), metadata=token,
                                                                 timeout=10)
            assert st.instance_id == host.instance_id
    finally:
        if host is not None:
            host.stop()
        sched.stop()
