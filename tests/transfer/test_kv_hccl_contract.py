"""Contract test of the HCCL path, on CPU, against tests/fakes/torch_npu_fake.py (torch_npu's
semantics: non-blocking wait, lazy communicator, no-op Backend.abort, teardown watchdog, per-thread
device and stream), over a real gloo transport and rendezvous store. Pins what the KV hop does
through `platform/npu.py`: the ProcessGroupHCCL constructor and its timeout, the handshake that
builds the communicator in the connect thread, send/recv names, ranks, tags, uint8 payloads and
their order (HCCL ignores tags), which thread posts what on which stream, completion by polling
(never wait(), never a device-wide synchronize), and abort_hccl_comm to break a pair.
"""
from __future__ import annotations

import os
import sys
import time
from datetime import timedelta

import pytest
import torch

from epdserve.engine.kv_cache import KVCacheSpec, PagedKVCache
from epdserve.platform.npu import NpuPlatform
from epdserve.transfer.kv import (
    KVReceiver, KVSender, KVTransferConfig, RecvRequest, RendezvousServer, SendRequest, TransferState,
)
from tests.fakes.torch_npu_fake import FakeTorchNpu

SPEC = KVCacheSpec(num_layers=2, num_kv_heads=2, head_dim=4, block_size=4, dtype=torch.bfloat16)
CFG = KVTransferConfig(timeout_s=7.0, bootstrap_timeout_s=10.0, connect_timeout_s=11.0)


@pytest.fixture
def fake(monkeypatch):
    monkeypatch.setenv("TORCH_HCCL_ASYNC_ERROR_HANDLING", "-")  # recorded, so what epdserve sets is undone
    monkeypatch.delenv("TORCH_HCCL_ASYNC_ERROR_HANDLING")
    return FakeTorchNpu().install(monkeypatch)


def _finish(tx, rx, rid: str) -> None:
    deadline = time.monotonic() + 10
    while not (tx.status(rid).state.finished and rx.status(rid).state.finished):
        assert time.monotonic() < deadline, "transfer did not finish"
        time.sleep(0.005)


def test_hccl_calls_threads_and_streams(fake):
    npu = NpuPlatform()
    server = RendezvousServer()
    tx, rx = KVSender(PagedKVCache(SPEC, 8), npu, CFG), KVReceiver(PagedKVCache(SPEC, 8), npu, CFG)
    try:
        rdzv = server.rendezvous("p0-d0/g0")
        pairs = tx.connect("d0", rdzv), rx.connect("p0", rdzv.for_peer())  # both must arrive
        assert all(p.wait_ready(10) for p in pairs), [p.error for p in pairs]
        group_timeout = timedelta(seconds=CFG.connect_timeout_s + CFG.timeout_s)
        assert sorted(e[2:] for e in fake.of("ProcessGroupHCCL")) == [
            (0, 2, "epdserve-kv/p0-d0/g0", group_timeout), (1, 2, "epdserve-kv/p0-d0/g0", group_timeout)]
        assert os.environ["TORCH_HCCL_ASYNC_ERROR_HANDLING"] == "0"  # no teardown watchdog
        # The communicator (a blocking rendezvous) is built by each side's connect thread, on its device.
        assert sorted((e[0], e[2], e[3]) for e in fake.of("comm_init")) == [
            ("kv-connect:p0-d0/g0", 0, 0), ("kv-connect:p0-d0/g0", 1, 0)]

        rx.expect(RecvRequest("r", "p0", (1, 2, 6), 10))  # two chunks on D: blocks 1-2, then 6
        tx.begin_batch([SendRequest("r", "d0", (5, 0, 3), (1, 2, 6), 10)])
        for layer in range(SPEC.num_layers):  # this thread plays P's forward
            tx.save_layer(layer)
        _finish(tx, rx, "r")
        assert tx.status("r").state is rx.status("r").state is TransferState.DONE
    finally:
        tx.close()
        rx.close()
        server.close()

    block_bytes = SPEC.block_size * SPEC.num_kv_heads * SPEC.head_dim * 2
    # K, V of chunk 1; K, V of chunk 2; then the bytes sent on the link this layer (one int64)
    per_layer = [2 * block_bytes, 2 * block_bytes, block_bytes, block_bytes, 8]
    ops = [e for e in fake.events if e[1] in ("send", "recv")]
    p_ops = [(e[1], e[3], e[4], e[5], e[6]) for e in ops if e[2] == 0]
    d_ops = [(e[1], e[3], e[4], e[5], e[6]) for e in ops if e[2] == 1]
    kv = per_layer * SPEC.num_layers
    assert p_ops == [("send", 1, 0, torch.uint8, 1)] + [("send", 1, 0, torch.uint8, n) for n in kv] + [("recv", 1, 0, torch.uint8, 1)]
    assert d_ops == [("recv", 0, 0, torch.uint8, 1)] + [("recv", 0, 0, torch.uint8, n) for n in kv] + [("send", 0, 0, torch.uint8, 1)]
    # P's forward thread posts the KV and the acknowledgement's receive (it never waits on them);
    # D's receiver thread posts D's side; the handshake is the connect threads'.
    assert [e[0] for e in ops if e[2] == 0] == ["kv-connect:p0-d0/g0"] + ["MainThread"] * (len(kv) + 1)
    assert [e[0] for e in ops if e[2] == 1] == ["kv-connect:p0-d0/g0"] + ["kv-recv:p0"] * (len(kv) + 1)
    # Completion is polled: no HCCL wait() ever chains a stream to the peer, nothing synchronizes
    # the whole device, and every pair thread runs on a side stream of its own.
    assert fake.of("work.wait") == [] and fake.of("synchronize") == []
    side = {e[0]: e[2] for e in fake.of("set_stream")}
    assert set(side) == {"kv-connect:p0-d0/g0", "kv-send:d0", "kv-recv:p0"} and 0 not in side.values()
    assert {e[7] for e in ops if e[0] == "kv-recv:p0"} == {side["kv-recv:p0"]}
    # close() breaks HCCL pairs with the real abort; the no-op Backend.abort is never relied on.
    assert sorted(e[2] for e in fake.of("abort_hccl_comm")) == [0, 1] and fake.of("pg.abort") == []


def test_without_torch_npu_the_npu_pair_fails_cleanly(monkeypatch):
    monkeypatch.setitem(sys.modules, "torch_npu", None)  # import raises ImportError
    server = RendezvousServer()
    tx = KVSender(PagedKVCache(SPEC, 8), NpuPlatform(), CFG)
    try:
        pair = tx.connect("d0", server.rendezvous("x"))
        assert pair.wait_ready(10) is False
        assert "could not build the process group (hccl" in pair.error
    finally:
        tx.close()
        server.close()
