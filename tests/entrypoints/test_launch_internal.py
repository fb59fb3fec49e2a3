"""`epdserve launch --internal-port 0 --internal-tls-*` as real processes, with a cluster token from
the environment and a self-signed certificate made here: the scheduler serves the Registry on
its own port (not on the public one), which only a client presenting a certificate of the CA
and the token reaches; the instances registered there, serve over mutual TLS only, and the
launched P-D deployment answers, greedy, as transformers' `generate` does."""
from __future__ import annotations

import os
import re

import grpc
import pytest

from epdserve.client import Client
from epdserve.model.reference import ReferenceGenerator
from epdserve.rpc import instance_pb2, instance_pb2_grpc
from epdserve.security.tls import channel_credentials
from tests.entrypoints.launch_harness import launched as launch_process
from tests.instance.harness import PH, image
from tests.security.certs import self_signed

pytestmark = pytest.mark.slow

READY = re.compile(r"^epdserve ready: grpc://(?P<public>\S+) mode=\S+ .* internal=grpc://(?P<internal>\S+)")
TOKEN = "launch-internal-token"
TOKEN_MD = [("epdserve-cluster-token", TOKEN)]


@pytest.fixture(scope="module")
def launched(qwen2_vl_tiny, tmp_path_factory):
    cert, key = self_signed(tmp_path_factory.mktemp("mtls"))
    args = ["--mode", "P-D", "--model", str(qwen2_vl_tiny), "--kv-cache-mb", "16", "--internal-port", "0",
            "--internal-host", "127.0.0.1", "--internal-tls-cert", cert, "--internal-tls-key", key,
            "--internal-tls-ca", cert]
    env = {k: v for k, v in os.environ.items() if k != "EPDSERVE_API_KEY"}
    with launch_process(args, dict(env, EPDSERVE_CLUSTER_TOKEN=TOKEN), READY, secrets=(TOKEN,)) as (found, _):
        yield found, cert, key


def _code(call) -> grpc.StatusCode:
    with pytest.raises(grpc.RpcError) as e:
        call()
    return e.value.code()


def test_launched_registry_on_its_own_mutual_tls_port(launched, qwen2_vl_tiny, monkeypatch):
    found, cert, key = launched
    assert found["internal"] != found["public"]
    prompt, img = f"Describe {PH} briefly.", image(7)
    monkeypatch.delenv("EPDSERVE_CLUSTER_TOKEN", raising=False)
    with Client(found["public"], timeout=120) as c:
        assert c.generate(prompt, images=[img], max_tokens=8, ignore_eos=True).token_ids == \
            ReferenceGenerator(qwen2_vl_tiny).generate(prompt, [img], max_tokens=8)
    beat = instance_pb2.HeartbeatRequest(instance_id="nobody")
    with grpc.insecure_channel(found["public"]) as ch:  # the public port no longer serves the Registry
        assert _code(lambda: instance_pb2_grpc.RegistryStub(ch).Heartbeat(beat, metadata=TOKEN_MD, timeout=10)) \
            == grpc.StatusCode.UNIMPLEMENTED
    for ch in (grpc.insecure_channel(found["internal"]),  # plaintext, or TLS without a client certificate
               grpc.secure_channel(found["internal"], channel_credentials(cert))):
        with ch:
            assert _code(lambda: instance_pb2_grpc.RegistryStub(ch).Heartbeat(beat, metadata=TOKEN_MD, timeout=10)) \
                == grpc.StatusCode.UNAVAILABLE
    with grpc.secure_channel(found["internal"], channel_credentials(cert, cert, key)) as ch:
        registry = instance_pb2_grpc.RegistryStub(ch)
        assert _code(lambda: registry.Heartbeat(beat, timeout=10)) == grpc.StatusCode.UNAUTHENTICATED  # no token
        assert registry.Heartbeat(beat, metadata=TOKEN_MD, timeout=10).known is False
    monkeypatch.setenv("EPDSERVE_CLUSTER_TOKEN", TOKEN)  # a token holder sees the instances' addresses
    with Client(found["public"], timeout=30) as c:
        addresses = [i.address for i in c.server_info().instances]
    assert len(addresses) == 2 and all(addresses)
    for address in addresses:  # each instance: mutual TLS only, and the token
        with grpc.insecure_channel(address) as ch:
            assert _code(lambda: instance_pb2_grpc.InstanceStub(ch).GetLoad(
                instance_pb2.GetLoadRequest(), metadata=TOKEN_MD, timeout=10)) == grpc.StatusCode.UNAVAILABLE
        with grpc.secure_channel(address, channel_credentials(cert, cert, key)) as ch:
            st = instance_pb2_grpc.InstanceStub(ch).GetLoad(instance_pb2.GetLoadRequest(), metadata=TOKEN_MD,
                                                            timeout=10)
            assert st.address == address
