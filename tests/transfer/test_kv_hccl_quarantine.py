"""The stuck-receive gap: after a stalled HCCL pair's teardown (HcclCommDestroy returned
HCCL_E_AGAIN, ignored by torch_npu), D's receive may still write into the request's blocks until
HCCL_EXEC_TIMEOUT. The request fails at once, but its blocks stay held (the connector's
`request_finished` → True, the engine's KV_HELD) until that receive ends or the bound passes.
Over tests/fakes/torch_npu_fake.py (E_AGAIN: tests/fakes/hccl_destroy.py)."""
from __future__ import annotations

import time
from types import SimpleNamespace

import pytest
import torch

from epdserve.engine.kv_cache import KVCacheSpec, PagedKVCache
from epdserve.platform.cpu import CpuPlatform
from epdserve.platform.npu import NpuPlatform
from epdserve.seams.kv_connector import RemotePrefill
from epdserve.transfer.kv import KVReceiver, KVSender, KVTransferConfig, RecvRequest, RendezvousServer, SendRequest
from epdserve.transfer.kv.recv_connector import LayerwiseRecvConnector
from epdserve.transfer.kv.state import TransferState, TransferStatus
from tests.fakes.torch_npu_fake import FakeTorchNpu
from tests.harness import wait_until

SPEC = KVCacheSpec(num_layers=2, num_kv_heads=2, head_dim=4, block_size=4, dtype=torch.bfloat16)
CFG = KVTransferConfig(timeout_s=1.0, bootstrap_timeout_s=10.0, connect_timeout_s=10.0)
EXEC_TIMEOUT_S = 4.0


def test_a_stalled_receive_quarantines_its_blocks_until_it_ends(monkeypatch):
    monkeypatch.delenv("TORCH_HCCL_ASYNC_ERROR_HANDLING", raising=False)
    monkeypatch.delenv("TORCH_HCCL_HIGH_PRIORITY", raising=False)
    monkeypatch.setenv("HCCL_EXEC_TIMEOUT", "600")  # the bound: the work's end comes first here
    fake = FakeTorchNpu().install(monkeypatch)
    fake.exec_timeout_s = EXEC_TIMEOUT_S
    npu = NpuPlatform()
    npu.set_thread_device(0)
    server = RendezvousServer()
    tx, rx = KVSender(PagedKVCache(SPEC, 8), npu, CFG), KVReceiver(PagedKVCache(SPEC, 8), npu, CFG)
    try:
        r = server.rendezvous("p0-a/g0")
        pairs = [tx.connect("a", r), rx.connect("p0", r.for_peer())]
        assert all(p.wait_ready(10) for p in pairs), [p.error for p in pairs]
        rx.expect(RecvRequest("stalled", "p0", (1, 2), 8))
        tx.begin_batch([SendRequest("stalled", "a", (3, 4), (1, 2), 8)])  # and never a layer
        wait_until(lambda: rx.status("stalled").state.finished, 10.0, "the stalled transfer did not fail")
        assert rx.status("stalled").state is TransferState.FAILED
        assert rx.quarantined("stalled") and rx.pop_released() == []  # the receive may still write
        tx.abort_batch("peer stalled")
        wait_until(lambda: rx.pop_released() == ["stalled"], EXEC_TIMEOUT_S + 5, "not released at HCCL_EXEC_TIMEOUT")
        assert not rx.quarantined("stalled")
    finally:
        tx.close()
        rx.close()
        server.close()


def test_the_bound_releases_a_receive_that_never_ends(monkeypatch):
    monkeypatch.setenv("HCCL_EXEC_TIMEOUT", "0")
    monkeypatch.setattr(NpuPlatform, "stuck_work_bound_s", lambda self: 0.05)
    rx = KVReceiver(PagedKVCache(SPEC, 8), NpuPlatform(), CFG)
    never = SimpleNamespace(is_completed=lambda: False)
    exp = SimpleNamespace(req=RecvRequest("r", "p0", (1, 2), 8), state=TransferState.TRANSFERRING, error=None)
    rx._fail_accepted([exp], "pair broken", [never])
    assert rx.quarantined("r") and rx.pop_released() == []
    t0, released = time.monotonic(), []
    while not released and time.monotonic() - t0 < 10:  # released once the 0.05 s bound has passed
        released = rx.pop_released()
        time.sleep(0.005)
    assert released == ["r"]


def test_a_tp_receiver_holds_a_broken_batch_until_the_bound_for_its_other_ranks(monkeypatch):
    """D at TP2 on HCCL: rank 0's own receives all ended, but rank 1's into the same blocks are its
    own to see, so the batch stays quarantined until the bound; on gloo nothing is held."""
    monkeypatch.setattr(NpuPlatform, "stuck_work_bound_s", lambda self: 0.2)
    rx = KVReceiver(PagedKVCache(SPEC, 8), NpuPlatform(), CFG)
    exp = SimpleNamespace(req=RecvRequest("r", "p0", (1, 2), 8), state=TransferState.TRANSFERRING, error=None)
    rx._fail_accepted([exp], "pair broken", [], others=True)
    assert exp.state is TransferState.FAILED and rx.quarantined("r") and rx.pop_released() == []
    wait_until(lambda: rx.pop_released() == ["r"], 10.0, "released once the bound passed")
    one = SimpleNamespace(req=RecvRequest("s", "p0", (1, 2), 8), state=TransferState.TRANSFERRING, error=None)
    rx._fail_accepted([one], "pair broken", [])  # TP1: nothing stuck, nothing held
    assert not rx.quarantined("s")
    cpu = KVReceiver(PagedKVCache(SPEC, 8), CpuPlatform(), CFG)
    two = SimpleNamespace(req=RecvRequest("t", "p0", (1, 2), 8), state=TransferState.TRANSFERRING, error=None)
    cpu._fail_accepted([two], "pair broken", [], others=True)
    assert not cpu.quarantined("t")


def test_gloo_keeps_freeing_at_once():
    """CPU / gloo: the interrupt closes the pair, its pending receives end within the drain
    (no `stuck_work_bound_s`), so nothing is quarantined even if one were reported left over."""
    rx = KVReceiver(PagedKVCache(SPEC, 8), CpuPlatform(), CFG)
    exp = SimpleNamespace(req=RecvRequest("r", "p0", (1, 2), 8), state=TransferState.TRANSFERRING, error=None)
    rx._fail_accepted([exp], "pair broken", [SimpleNamespace(is_completed=lambda: False)])
    assert not rx.quarantined("r")


class _Receiver:
    """KVReceiver's engine protocol, with one FAILED transfer whose receive is stuck."""

    leaked_communicators = 0

    def __init__(self):
        self.failed, self.stuck, self.released = [], set(), []

    def expect(self, req):
        pass

    def cancel(self, rid):
        return False

    def pop_finished(self):
        out, self.failed = self.failed, []
        return out

    def quarantined(self, rid):
        return rid in self.stuck

    def pop_released(self):
        out, self.released = self.released, []
        return out


def test_the_connector_fails_the_request_but_holds_its_blocks():
    conn = LayerwiseRecvConnector("d0")
    conn.receiver, conn._block_size = _Receiver(), 4
    seq = SimpleNamespace(request_id="r", prompt_len=8, num_computed_tokens=0,
                          handoff=SimpleNamespace(kv_transfer=RemotePrefill("p0")))
    conn.on_blocks_allocated(seq, [1, 2, 3])
    conn.receiver.failed = [TransferStatus("r", "p0", TransferState.FAILED, 0, 2, "pair broken")]
    conn.receiver.stuck.add("r")
    _, received = conn.get_finished()
    assert [(f.request_id, f.error) for f in received] == [("r", "pair broken")]  # the request fails now
    assert conn.request_finished(seq) is True  # ... and the engine holds its blocks (KV_HELD)
    assert conn.get_finished() == ([], [])
    conn.receiver.released = ["r"]
    _, received = conn.get_finished()
    assert [f.request_id for f in received] == ["r"]  # now the engine frees them
    assert not conn.has_pending()
