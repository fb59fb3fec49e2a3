"""A scheduler dies mid-stream and no request is lost: two schedulers share one instance (it
registers with both), `Client([a, b])` / `AsyncClient` resume on the other one — or on the same
address once it is back — from the token ids already received, and outputs stay equal to
transformers'. A resumed request is validated like any other."""
from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
from pathlib import Path

import grpc
import pytest

from epdserve.client import AsyncClient, Client, EPDServeError
from epdserve.model.reference import ReferenceGenerator
from epdserve.rpc import serve_pb2, serve_pb2_grpc
from tests.instance.harness import PH, image, wait_until

pytestmark = pytest.mark.slow

MAX_TOKENS = 512  # long enough that a request polled in flight is still running when its scheduler is killed
PROMPT = f"Describe {PH} at length."


def _spawn(argv: list[str], log: Path) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", *argv], stdout=open(log, "w"), stderr=subprocess.STDOUT,
                            start_new_session=True)


def _scheduler(model, tmp: Path, name: str, port: int = 0, internal_port: int = 0
               ) -> tuple[subprocess.Popen, str, str]:
    """A scheduler process: (process, public host:port, internal host:port instances register at)."""
    addr_file, internal_file = tmp / f"{name}.address", tmp / f"{name}.internal"
    addr_file.unlink(missing_ok=True)
    p = _spawn(["epdserve.entrypoints.scheduler_cli", "--model", str(model), "--port", str(port),
                "--internal-port", str(internal_port), "--address-file", str(addr_file),
                "--internal-address-file", str(internal_file)], tmp / f"{name}.log")
    wait_until(lambda: addr_file.exists() or p.poll() is not None, 120, f"scheduler {name}")
    assert p.poll() is None, (tmp / f"{name}.log").read_text()
    return p, addr_file.read_text().strip(), internal_file.read_text().strip()


def _healthy(address: str) -> bool:
    try:
        with Client(address, timeout=5, retries=0) as c:
            return any(i.health == 1 for i in c.server_info().instances)
    except EPDServeError:
        return False


def _stop(*procs: subprocess.Popen) -> None:
    for p in procs:
        if p.poll() is None:
            os.killpg(p.pid, signal.SIGKILL)
            p.wait()


@pytest.fixture(scope="module")
def reference(qwen2_vl_tiny):
    return ReferenceGenerator(qwen2_vl_tiny).generate(PROMPT, [image(9, 84, 84)], max_tokens=MAX_TOKENS)


def test_a_dead_scheduler_loses_no_request(qwen2_vl_tiny, reference, tmp_path):
    a, addr_a, reg_a = _scheduler(qwen2_vl_tiny, tmp_path, "a")
    b, addr_b, reg_b = _scheduler(qwen2_vl_tiny, tmp_path, "b")
    inst = _spawn(["epdserve.entrypoints.cli", "instance", "--roles", "EPD", "--model", str(qwen2_vl_tiny),
                   "--kv-cache-mb", "16", "--scheduler", f"{reg_a},{reg_b}"], tmp_path / "instance.log")
    procs = [a, b, inst]
    try:
        wait_until(lambda: inst.poll() is not None or (_healthy(addr_a) and _healthy(addr_b)), 180,
                   "the instance on both schedulers")
        assert inst.poll() is None, (tmp_path / "instance.log").read_text()[-3000:]

        # sync: a dies after the first tokens; the stream goes on from b
        with Client([addr_a, addr_b], timeout=300) as c:
            ids = []
            for d in c.generate_stream(PROMPT, images=[image(9, 84, 84)], max_tokens=MAX_TOKENS, ignore_eos=True):
                ids.extend(d.token_ids)
                if ids and a.poll() is None:
                    os.killpg(a.pid, signal.SIGKILL)
                    a.wait()
            assert ids == reference
            assert c.retried >= 1 and c.address == addr_b

        # a comes back on its port; the instance registers with it again
        a, _, _ = _scheduler(qwen2_vl_tiny, tmp_path, "a", port=int(addr_a.rsplit(":", 1)[1]),
                             internal_port=int(reg_a.rsplit(":", 1)[1]))
        procs.append(a)
        wait_until(lambda: _healthy(addr_a), 120, "the instance to register with the restarted scheduler")

        # async, unary: b dies mid-request; the result comes from a
        async def run():
            async with AsyncClient([addr_b, addr_a], timeout=300) as c:
                for _ in range(3):
                    task = asyncio.ensure_future(c.generate(PROMPT, images=[image(9, 84, 84)],
                                                            max_tokens=MAX_TOKENS, ignore_eos=True))
                    await asyncio.to_thread(wait_until, lambda: task.done() or _in_flight(addr_b), 60,
                                            "the request on b")
                    if not task.done():
                        os.killpg(b.pid, signal.SIGKILL)
                        return await task, c.retried
                    # b served it whole before a poll saw it in flight (or failed it: result() raises that)
                    assert task.result().token_ids == reference and c.retried == 0, _logs(tmp_path)
                raise AssertionError("every request finished before b could be killed")
        out, retried = asyncio.run(run())
        assert out.token_ids == reference and out.finish_reason == "length"
        assert out.usage.output_tokens == MAX_TOKENS
        assert retried >= 1

        # a resumed request is validated: nothing left of max_tokens, or ids out of range
        with grpc.insecure_channel(addr_a) as ch:
            stub = serve_pb2_grpc.EPDServeStub(ch)
            for resume in ([1] * 8, [10 ** 9]):
                req = serve_pb2.GenerateRequest(prompt="hi", resume_token_ids=resume)
                req.sampling.max_tokens = 8
                with pytest.raises(grpc.RpcError) as e:
                    stub.Generate(req, timeout=60)
                assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    finally:
        _stop(*procs)


def _logs(tmp: Path) -> str:
    return "\n".join(f"--- {p.name}\n{p.read_text()[-2000:]}" for p in sorted(tmp.glob("*.log")))


def _in_flight(address: str) -> bool:
    try:
        with Client(address, timeout=5, retries=0) as c:
            return c.server_info().requests_in_flight > 0
    except EPDServeError:
        return False
