"""Proto codegen (generated, import-rewritten, regenerated only when stale) and the server helpers
(health SERVING / NOT_SERVING, reflection listing the services) on sync and asyncio servers."""
import asyncio
from concurrent import futures

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc
from google.protobuf.descriptor_pb2 import FileDescriptorProto
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

from epdserve.rpc import INSTANCE_SERVICE, SERVE_SERVICE, codegen, common_pb2, instance_pb2, serve_pb2
from epdserve.rpc.servers import add_health_and_reflection, free_port, set_serving, set_serving_aio


def test_generate_rewrites_imports_and_stamps(tmp_path):
    out = tmp_path / "proto_gen"
    codegen.generate(out)
    pkg = out / "epdserve" / "v1"
    names = sorted(p.name for p in pkg.glob("*.py"))
    assert {"common_pb2.py", "serve_pb2.py", "serve_pb2_grpc.py", "instance_pb2.py", "instance_pb2_grpc.py"} <= set(names)
    text = (pkg / "serve_pb2.py").read_text()
    assert "from epdserve.proto_gen.epdserve.v1 import common_pb2" in text
    assert "from epdserve.v1 import" not in text
    stamp = (out / ".stamp").read_text()
    assert stamp == codegen.sources_digest()
    before = (pkg / "serve_pb2.py").stat().st_mtime_ns
    codegen.ensure_generated(out)  # current: nothing regenerated
    assert (pkg / "serve_pb2.py").stat().st_mtime_ns == before
    (out / ".stamp").write_text("stale")
    codegen.ensure_generated(out)
    assert (out / ".stamp").read_text() == stamp


def test_messages_cover_the_contract():
    sp = common_pb2.SamplingParams(temperature=0.5)
    assert sp.HasField("temperature") and not sp.HasField("top_p")  # unset = SamplingParams default
    fields = {f.name for f in common_pb2.SamplingParams.DESCRIPTOR.fields}
    from dataclasses import fields as dc_fields

    from epdserve.engine.sampling_params import SamplingParams

    assert fields == {f.name for f in dc_fields(SamplingParams)}
    assert set(serve_pb2.DESCRIPTOR.services_by_name["EPDServe"].methods_by_name) == {
        "Generate", "GenerateStream", "Abort", "GetModelInfo", "GetServerInfo"}
    assert set(instance_pb2.DESCRIPTOR.services_by_name["Instance"].methods_by_name) == {
        "Encode", "Prefill", "Decode", "Generate", "Abort", "GetLoad", "SwitchRoles"}
    assert set(instance_pb2.DESCRIPTOR.services_by_name["Registry"].methods_by_name) == {
        "Register", "Heartbeat", "Deregister"}


def _list_services(address):
    with grpc.insecure_channel(address) as ch:
        stub = reflection_pb2_grpc.ServerReflectionStub(ch)
        resp = next(iter(stub.ServerReflectionInfo(iter([reflection_pb2.ServerReflectionRequest(list_services="")]))))
        return {s.name for s in resp.list_services_response.service}


def _file_for(address, symbol):
    with grpc.insecure_channel(address) as ch:
        stub = reflection_pb2_grpc.ServerReflectionStub(ch)
        req = reflection_pb2.ServerReflectionRequest(file_containing_symbol=symbol)
        resp = next(iter(stub.ServerReflectionInfo(iter([req]))))
        return [FileDescriptorProto.FromString(b).name for b in resp.file_descriptor_response.file_descriptor_proto]


def _check(address, service=""):
    with grpc.insecure_channel(address) as ch:
        resp = health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(service=service), timeout=5)
        return health_pb2.HealthCheckResponse.ServingStatus.Name(resp.status)


def test_health_and_reflection_on_a_sync_server():
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
    address = f"127.0.0.1:{free_port()}"
    server.add_insecure_port(address)
    health = add_health_and_reflection(server, [INSTANCE_SERVICE])
    set_serving(health, [INSTANCE_SERVICE])
    server.start()
    try:
        assert _check(address) == "SERVING" and _check(address, INSTANCE_SERVICE) == "SERVING"
        assert {INSTANCE_SERVICE, "grpc.health.v1.Health", "grpc.reflection.v1alpha.ServerReflection"} <= _list_services(address)
        set_serving(health, [INSTANCE_SERVICE], serving=False)
        assert _check(address) == "NOT_SERVING"
    finally:
        server.stop(0)


def test_health_and_reflection_on_an_asyncio_server():
    address = f"127.0.0.1:{free_port()}"

    async def main():
        server = grpc.aio.server()
        server.add_insecure_port(address)
        health = add_health_and_reflection(server, [SERVE_SERVICE])
        await server.start()
        await set_serving_aio(health, [SERVE_SERVICE])
        try:
            return await asyncio.to_thread(lambda: (_check(address, SERVE_SERVICE), _list_services(address),
                                                    _file_for(address, "epdserve.v1.GenerateRequest")))
        finally:
            await server.stop(0)

    status, names, files = asyncio.run(main())
    assert status == "SERVING" and SERVE_SERVICE in names
    assert "epdserve/v1/serve.proto" in files  # grpcurl can describe and call the service
