"""An attempt killed while its Decode stream is still being opened ends at once.

The regression: a D died just as the scheduler opened a Decode stream to it; the registry marked it
down and the attempt was killed (its calls cancelled), but grpc.aio's stream `write()` waits for the
call's initial metadata to be sent and does not wake on cancel, so the request hung forever (a CI
run of test_launch's kill-a-D test). Here the "D" is a TCP listener that never speaks HTTP/2: the
stream stays unopened, exactly as with a peer that is gone, over a real grpc.aio channel.
"""
from __future__ import annotations

import asyncio
import socket
import threading
import time

import grpc
import pytest

from epdserve.rpc import common_pb2
from epdserve.scheduler.attempt import Attempt, AttemptInputs
from epdserve.scheduler.channels import ChannelPool
from epdserve.scheduler.errors import InstanceError
from epdserve.scheduler.registry import InstanceRecord
from epdserve.scheduler.routing import Plan, WorkLease


async def _killed_while_opening(silent_address: str, connected: threading.Event) -> InstanceError:
    p = InstanceRecord("P-1", "P", "127.0.0.1:1")  # never reached: D is asked first
    d = InstanceRecord("D-1", "D", silent_address)
    channels = ChannelPool()
    inputs = AttemptInputs("r#1", [1, 2, 3], [], common_pb2.SamplingParams(max_tokens=4), 0)
    attempt = Attempt(inputs, Plan(prefill=p, decode=d), WorkLease(), channels, registry=None, background=set())
    loop = asyncio.get_running_loop()

    async def drive():
        async for _ in attempt.run():
            pass

    task = loop.create_task(drive())
    deadline = time.monotonic() + 30
    while not connected.is_set() and not task.done() and time.monotonic() < deadline:
        await asyncio.sleep(0.01)  # until the channel reached the silent peer: the write waits on its preface
    assert connected.is_set() and not task.done()
    attempt.kill("D-1", "instance D-1 is down")
    try:
        await asyncio.wait_for(task, timeout=60.0)  # a bound for a hang, not a timing
    except InstanceError as e:
        return e
    finally:
        attempt.close(abort=False)
        await channels.close()
    raise AssertionError("the attempt ended without an error")


def test_kill_wakes_a_decode_write_that_the_stream_never_sent():
    with socket.socket() as silent:
        silent.bind(("127.0.0.1", 0))
        silent.listen(8)  # accepts the TCP connection, never answers the HTTP/2 preface
        connected, held = threading.Event(), []

        def accept():
            try:
                held.append(silent.accept()[0])  # kept open, never written to
                connected.set()
            except OSError:
                pass

        threading.Thread(target=accept, daemon=True).start()
        try:
            err = asyncio.run(_killed_while_opening(f"127.0.0.1:{silent.getsockname()[1]}", connected))
        finally:
            for conn in held:
                conn.close()
    assert err.instance_id == "D-1"
    assert err.code == grpc.StatusCode.UNAVAILABLE
    assert "down" in err.message  # the kill's reason: the silent peer never answers, so only the kill ends the call


def test_an_attempt_killed_before_it_starts_raises_without_calling():
    """A kill that lands before the first step: no RPC is awaited at all."""

    async def run():
        d = InstanceRecord("D-1", "D", "127.0.0.1:9")
        channels = ChannelPool()
        inputs = AttemptInputs("r#1", [1], [], common_pb2.SamplingParams(max_tokens=1), 0)
        attempt = Attempt(inputs, Plan(prefill=InstanceRecord("P-1", "P", "127.0.0.1:9"), decode=d), WorkLease(),
                          channels, registry=None, background=set())
        attempt.kill("D-1", "gone")
        with pytest.raises(InstanceError, match="gone"):
            async for _ in attempt.run():
                pass
        attempt.close(abort=False)
        await channels.close()

    asyncio.run(run())
