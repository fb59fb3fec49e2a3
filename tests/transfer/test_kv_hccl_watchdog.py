"""One stalled KV pair must fail its transfers, not the process, under torch_npu's watchdog.

torch_npu's ProcessGroupHCCL watchdog ends the process (SIGABRT) when a work stays pending past
the group timeout and TORCH_HCCL_ASYNC_ERROR_HANDLING is TearDown — its default. Both peers run
as processes over tests/fakes/torch_npu_fake.py, with a group timeout of a few seconds and a
prefill side that stalls past it. With epdserve's setting the decode process fails the transfer
and keeps serving; the control run, with the operator forcing TearDown, shows the same stall
does kill a process (so the fake's watchdog is real and the first run means something).
"""
from __future__ import annotations

import json
import signal
import time

import pytest

from tests.transfer.test_kv_transfer import BACKEND_ENV, CFG_ENV, Peer

CONNECT_S, TIMEOUT_S = 5.0, 2.0  # group timeout = CONNECT_S + TIMEOUT_S = 7 s
STALL_S = 11.0


@pytest.mark.parametrize("handling", [None, "1"])
def test_a_stalled_pair_outlives_the_hccl_watchdog(handling, monkeypatch):
    monkeypatch.setenv(BACKEND_ENV, "fake-hccl")
    monkeypatch.setenv(CFG_ENV, json.dumps({"timeout_s": TIMEOUT_S, "connect_timeout_s": CONNECT_S}))
    if handling is None:
        monkeypatch.delenv("TORCH_HCCL_ASYNC_ERROR_HANDLING", raising=False)
    else:
        monkeypatch.setenv("TORCH_HCCL_ASYNC_ERROR_HANDLING", handling)
    d, p = Peer("_decode_peer"), Peer("_prefill_peer")
    try:
        p.send(cmd="connect", pair_name="p0-d0/g0")
        d.send(cmd="connect", rdzv=p.wait("rdzv")["rdzv"])
        d.wait("ready")
        p.wait("ready")
        d.send(cmd="expect", request_id="r", num_tokens=20)
        dst = d.wait("reserved", request_id="r")
        p.send(cmd="send", request_id="r", num_tokens=20, dst=dst["blocks"], seed=3, stall_after=1, stall_s=STALL_S)
        p.wait("stalling")
        stalled_at = time.monotonic()
        ev = d.wait("finished", request_id="r", timeout_s=3 * TIMEOUT_S + 5)
        assert ev["state"] == "failed" and "Timed out" in ev["error"] and ev["pair"] == "broken"
        past_watchdog = stalled_at + CONNECT_S + TIMEOUT_S + 2.0
        if handling is None:  # the decode process is alive and serving, past the watchdog's deadline
            time.sleep(max(0.0, past_watchdog - time.monotonic()))
            d.send(cmd="expect", request_id="after", num_tokens=8)
            assert d.wait("reserved", request_id="after", timeout_s=10)["blocks"]
            assert d.proc.poll() is None
        else:  # TearDown: the watchdog's rethrow ended the process (waited for, not slept past)
            assert d.proc.wait(max(0.0, past_watchdog - time.monotonic()) + 10) == -signal.SIGABRT
    finally:
        d.stop()
        p.kill()  # still asleep in its stall
