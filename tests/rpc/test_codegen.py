"""Proto codegen (generated into a per-interpreter cache folder named by what it holds, import-
rewritten, never replaced; shipped inside a built wheel; never written into the source tree) and
the server helpers (health SERVING / NOT_SERVING, reflection listing the services) on sync and
asyncio servers."""
import asyncio
import os
import shutil
import subprocess
import sys
import zipfile
from concurrent import futures
from pathlib import Path

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc
from google.protobuf.descriptor_pb2 import FileDescriptorProto
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

import epdserve.proto_gen
from epdserve.proto_gen import codegen
from epdserve.rpc import INSTANCE_SERVICE, SERVE_SERVICE, common_pb2, instance_pb2, serve_pb2
from epdserve.rpc.servers import add_health_and_reflection, free_port, set_serving, set_serving_aio

REPO = Path(__file__).resolve().parents[2]


def test_generated_once_into_a_folder_named_by_its_sources(tmp_path):
    root = tmp_path / "cache"
    out = codegen.ensure_generated(root)
    assert out.parent == root and codegen.sources_digest().startswith(out.name)
    pkg = out / "epdserve" / "v1"
    names = {p.name for p in pkg.glob("*.py")}
    assert {"common_pb2.py", "serve_pb2.py", "serve_pb2_grpc.py", "instance_pb2.py", "instance_pb2_grpc.py"} <= names
    text = (pkg / "serve_pb2.py").read_text()
    assert "from epdserve.proto_gen.epdserve.v1 import common_pb2" in text and "from epdserve.v1 import" not in text
    before = (pkg / "serve_pb2.py").stat().st_mtime_ns
    assert codegen.ensure_generated(root) == out  # current: nothing regenerated
    assert (pkg / "serve_pb2.py").stat().st_mtime_ns == before

    protos = tmp_path / "proto"  # changed sources: a new folder beside the old one, which stays whole
    shutil.copytree(codegen.PROTO_ROOT, protos)
    common = protos / "epdserve" / "v1" / "common.proto"
    common.write_text(common.read_text() + "\nmessage CodegenProbe { int32 x = 1; }\n")
    out2 = codegen.ensure_generated(root, protos)
    assert out2 != out and "_CODEGENPROBE" in (out2 / "epdserve" / "v1" / "common_pb2.py").read_text()
    assert (pkg / "serve_pb2.py").stat().st_mtime_ns == before
    assert sorted(p.name for p in root.iterdir() if p.is_dir()) == sorted([out.name, out2.name])  # no temp left


def test_a_source_checkout_uses_the_cache_and_writes_nothing_into_the_tree():
    path = Path(epdserve.proto_gen.__path__[0])
    assert not (path / codegen.SHIPPED).exists()
    assert Path(serve_pb2.__file__).is_relative_to(path)
    pkg_dir = REPO / "epdserve" / "proto_gen"
    assert {p.name for p in pkg_dir.iterdir()} <= {"__init__.py", "codegen.py", "__pycache__"}


def test_processes_starting_at_once_generate_one_tree(tmp_path):
    cache = tmp_path / "cache"
    env = {**os.environ, "EPDSERVE_CACHE_DIR": str(cache)}
    code = "from epdserve.rpc import serve_pb2; print(serve_pb2.__file__)"
    procs = [subprocess.Popen([sys.executable, "-c", code], env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                              text=True) for _ in range(4)]
    outs = [p.communicate(timeout=120) for p in procs]
    assert [p.returncode for p in procs] == [0] * 4, [err for _, err in outs]
    files = {out.strip() for out, _ in outs}
    assert len(files) == 1
    trees = [p for p in (cache / "proto_gen").iterdir() if p.is_dir()]
    assert len(trees) == 1 and files.pop().startswith(str(trees[0]))


def test_a_built_wheel_ships_the_modules_and_uses_no_cache(tmp_path):
    wheels = tmp_path / "wheels"
    subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation",
                    "-w", str(wheels), str(REPO)], check=True, cwd=tmp_path, timeout=300)
    (wheel,) = wheels.glob("epdserve-*.whl")
    site = tmp_path / "site"
    with zipfile.ZipFile(wheel) as z:
        z.extractall(site)
        names = set(z.namelist())
    assert {"epdserve/proto_gen/.shipped", "epdserve/proto_gen/epdserve/v1/serve_pb2.py"} <= names
    cache = tmp_path / "cache"
    env = {**os.environ, "EPDSERVE_CACHE_DIR": str(cache), "PYTHONPATH": str(site)}
    out = subprocess.run([sys.executable, "-c", "from epdserve.rpc import serve_pb2; print(serve_pb2.__file__)"],
                         env=env, cwd=tmp_path, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == str(site / "epdserve" / "proto_gen" / "epdserve" / "v1" / "serve_pb2.py")
    assert not cache.exists()


def test_messages_cover_the_contract():
    sp = common_pb2.SamplingParams(temperature=0.5)
    assert sp.HasField("temperature") and not sp.HasField("top_p")  # unset = SamplingParams default
    fields = {f.name for f in common_pb2.SamplingParams.DESCRIPTOR.fields}
    from dataclasses import fields as dc_fields

    from epdserve.engine.sampling_params import SamplingParams

    assert fields == {f.name for f in dc_fields(SamplingParams)}
    assert set(serve_pb2.DESCRIPTOR.services_by_name["EPDServe"].methods_by_name) == {
        "Generate", "GenerateStream", "Abort", "GetModelInfo", "GetServerInfo", "UploadMedia", "GetUpload",
        "DeleteUpload"}
    assert set(instance_pb2.DESCRIPTOR.services_by_name["Instance"].methods_by_name) == {
        "Encode", "Prefill", "Decode", "Generate", "Abort", "GetLoad", "SwitchRoles", "KvStore", "DropMedia"}
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
