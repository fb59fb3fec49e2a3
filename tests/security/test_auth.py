"""API key on the public gRPC service and HTTP alike, the cluster token on the internal Registry
(its own port) and on every call to an instance, addresses only for token holders, and TLS with
a self-signed certificate made here — real scheduler, real instance host, real clients."""
from __future__ import annotations

import asyncio
import http.client
import json
import logging
import ssl

import grpc
import pytest

from epdserve import AsyncClient, Client
from epdserve.client import EPDServeError
from epdserve.entrypoints.http import HttpFront, HttpOptions
from epdserve.instance.config import InstanceConfig
from epdserve.instance.host import InstanceHost
from epdserve.instance.registration import Registrar
from epdserve.rpc import common_pb2, instance_pb2, instance_pb2_grpc
from epdserve.scheduler import SchedulerConfig, SchedulerThread
from epdserve.security import Secret
from epdserve.security.interceptors import cluster_metadata, metadata_interceptors
from epdserve.security.options import InstanceSecurity, SchedulerSecurity
from tests.instance.harness import wait_until
from tests.security.certs import self_signed

KEY, TOKEN = "sk-auth-test", "cluster-token-test"


@pytest.fixture(autouse=True)
def _no_env_secrets(monkeypatch):
    monkeypatch.delenv("EPDSERVE_API_KEY", raising=False)
    monkeypatch.delenv("EPDSERVE_CLUSTER_TOKEN", raising=False)


@pytest.fixture(scope="module")
def cert(tmp_path_factory):
    return self_signed(tmp_path_factory.mktemp("tls"))


@pytest.fixture(scope="module")
def secured(qwen2_vl_tiny, cert):
    security = SchedulerSecurity(api_key=Secret(KEY), cluster_token=Secret(TOKEN), internal_port=0,
                                 tls_cert=cert[0], tls_key=cert[1])
    sched = SchedulerThread(SchedulerConfig(model=str(qwen2_vl_tiny), probe_interval_s=0.2), security=security)
    sched.start()
    host = InstanceHost(InstanceConfig(roles="PD", model=str(qwen2_vl_tiny), scheduler=sched.server.internal_address,
                                       kv_cache_bytes=2 << 20), security=InstanceSecurity(Secret(TOKEN))).start()
    front = HttpFront(sched.server, HttpOptions(api_key=KEY, tls_cert=cert[0], tls_key=cert[1]))
    asyncio.run_coroutine_threadsafe(front.start(), sched.loop).result(30)
    try:
        assert host.wait_registered(30)
        wait_until(lambda: sched.call(sched.server.registry.records), what="the instance to register")
        yield sched, host, front
    finally:
        asyncio.run_coroutine_threadsafe(front.stop(), sched.loop).result(30)
        host.stop()
        sched.stop()


def test_grpc_needs_the_api_key(secured, cert, monkeypatch):
    sched = secured[0]
    for key in (None, "sk-wrong"):
        with Client(sched.address, timeout=30, api_key=key, tls_ca=cert[0]) as c:
            assert c.health() == "SERVING"  # health checks stay open
            for call in (lambda: c.generate("hi", max_tokens=2), c.server_info, c.model_info):
                with pytest.raises(EPDServeError) as e:
                    call()
                assert e.value.code == grpc.StatusCode.UNAUTHENTICATED
    with Client(sched.address, timeout=60, api_key=KEY, tls_ca=cert[0]) as c:
        r = c.generate("hello there", max_tokens=4, ignore_eos=True)
        assert len(r.token_ids) == 4
        assert [i.address for i in c.server_info().instances] == [""]  # no token: no addresses
    monkeypatch.setenv("EPDSERVE_CLUSTER_TOKEN", TOKEN)  # a token holder (Client sends it from the environment)
    with Client(sched.address, timeout=30, api_key=KEY, tls_ca=cert[0]) as c:
        assert [i.address for i in c.server_info().instances] == [f"127.0.0.1:{secured[1].port}"]


def test_async_client_streams_with_the_key_over_tls(secured, cert):
    async def run():
        async with AsyncClient(secured[0].address, timeout=60, api_key=KEY, tls_ca=cert[0]) as c:
            deltas = [d async for d in c.generate_stream("stream me", max_tokens=4, ignore_eos=True)]
        async with AsyncClient(secured[0].address, timeout=30, tls_ca=cert[0]) as c:
            with pytest.raises(EPDServeError) as e:
                [d async for d in c.generate_stream("no key", max_tokens=2)]
        return deltas, e.value.code

    deltas, code = asyncio.run(run())
    assert sum(len(d.token_ids) for d in deltas) == 4 and deltas[-1].finished
    assert code == grpc.StatusCode.UNAUTHENTICATED


def test_plaintext_client_cannot_talk_to_the_tls_port(secured):
    with Client(secured[0].address, timeout=5, api_key=KEY) as c:
        with pytest.raises(EPDServeError) as e:
            c.model_info()
        assert e.value.code == grpc.StatusCode.UNAVAILABLE


def test_http_needs_the_same_key_over_tls(secured, cert):
    front = secured[2]
    host, port = front.address.rsplit(":", 1)
    ctx = ssl.create_default_context(cafile=cert[0])
    for key, want in ((None, 401), ("sk-wrong", 401), (KEY, 200)):
        conn = http.client.HTTPSConnection(host, int(port), context=ctx, timeout=60)
        headers = {"Content-Type": "application/json", **({"Authorization": f"Bearer {key}"} if key else {})}
        conn.request("POST", "/v1/completions", body=json.dumps({"prompt": "hi", "max_tokens": 2}), headers=headers)
        resp = conn.getresponse()
        body = json.loads(resp.read())
        conn.close()
        assert resp.status == want, body
    assert body["usage"]["completion_tokens"] == 2


def test_registry_is_internal_and_needs_the_token(secured, cert, caplog):
    sched = secured[0]
    fake = common_pb2.InstanceStatus(instance_id="intruder", roles="PD", address="127.0.0.1:1", model="m")
    with grpc.insecure_channel(sched.server.internal_address) as ch:
        stub = instance_pb2_grpc.RegistryStub(ch)
        for md in ((), (("epdserve-cluster-token", "wrong"),)):
            with pytest.raises(grpc.RpcError) as e:
                stub.Register(instance_pb2.RegisterRequest(instance=fake), metadata=md, timeout=10)
            assert e.value.code() == grpc.StatusCode.UNAUTHENTICATED
    # the public (TLS) port does not serve the Registry at all
    with grpc.secure_channel(sched.address, grpc.ssl_channel_credentials(open(cert[0], "rb").read())) as ch:
        with pytest.raises(grpc.RpcError) as e:
            instance_pb2_grpc.RegistryStub(ch).Register(instance_pb2.RegisterRequest(instance=fake), timeout=10,
                                                        metadata=[("epdserve-cluster-token", TOKEN)])
        assert e.value.code() == grpc.StatusCode.UNIMPLEMENTED
    # an instance with a wrong token is refused, and the refusal is logged (the value never is)
    with caplog.at_level(logging.WARNING):
        reg = Registrar(sched.server.internal_address, lambda: fake, rpc_timeout_s=2,
                        interceptors=metadata_interceptors(cluster_metadata(Secret("not-the-token")))).start()
        assert not reg.registered.wait(1.5)
        reg.stop(deregister=False)
    assert "intruder" not in {r.instance_id for r in sched.call(sched.server.registry.records)}
    assert "refused /epdserve.v1.Registry/Register" in caplog.text
    assert "not-the-token" not in caplog.text and TOKEN not in caplog.text


def test_instance_needs_the_token_on_every_call(secured):
    host = secured[1]
    address = f"127.0.0.1:{host.port}"
    with grpc.insecure_channel(address) as ch:
        stub = instance_pb2_grpc.InstanceStub(ch)
        with pytest.raises(grpc.RpcError) as e:
            stub.GetLoad(instance_pb2.GetLoadRequest(), timeout=10)
        assert e.value.code() == grpc.StatusCode.UNAUTHENTICATED
        with pytest.raises(grpc.RpcError) as e:  # a response stream is refused the same way
            list(stub.Generate(instance_pb2.InstanceGenerateRequest(request_id="x"), timeout=10))
        assert e.value.code() == grpc.StatusCode.UNAUTHENTICATED
        st = stub.GetLoad(instance_pb2.GetLoadRequest(), metadata=[("epdserve-cluster-token", TOKEN)], timeout=10)
        assert st.instance_id == host.instance_id
    # and the scheduler's calls carry it: its probes keep the instance healthy, requests are served
    recs = secured[0].call(secured[0].server.registry.records)
    assert [r.health for r in recs] == [common_pb2.HEALTHY]
