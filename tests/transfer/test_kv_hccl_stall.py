"""A stalled HCCL pair fails only that pair, by CANN's destroy contract (tests/fakes/hccl_destroy.py):
torch_npu's abort_hccl_comm gets HCCL_E_AGAIN while D's receive still runs, ignores it, and the
receive keeps its HCCL stream until HCCL_EXEC_TIMEOUT. D's other pair, and the engine's streams,
are untouched: no stream of ours is HCCL's (platform/npu_streams.py). Over tests/fakes/torch_npu_fake.py.
"""
from __future__ import annotations


import pytest
import torch

from epdserve.engine.kv_cache import KVCacheSpec, PagedKVCache
from epdserve.platform.npu import NpuPlatform
from epdserve.transfer.kv import (
    KVReceiver, KVSender, KVTransferConfig, PairState, RecvRequest, RendezvousServer, SendRequest, TransferState,
)
from tests.fakes.hccl_destroy import HCCL_E_AGAIN
from tests.fakes.torch_npu_fake import FakeTorchNpu
from tests.harness import wait_until

SPEC = KVCacheSpec(num_layers=2, num_kv_heads=2, head_dim=4, block_size=4, dtype=torch.bfloat16)
CFG = KVTransferConfig(timeout_s=1.0, bootstrap_timeout_s=10.0, connect_timeout_s=10.0)
EXEC_TIMEOUT_S = 4.0


@pytest.fixture
def fake(monkeypatch):
    monkeypatch.delenv("TORCH_HCCL_ASYNC_ERROR_HANDLING", raising=False)
    monkeypatch.delenv("TORCH_HCCL_HIGH_PRIORITY", raising=False)
    fake = FakeTorchNpu().install(monkeypatch)
    fake.exec_timeout_s = EXEC_TIMEOUT_S
    return fake


def _transfer(tx, rx, rid: str, peer_of_tx: str, peer_of_rx: str) -> None:
    rx.expect(RecvRequest(rid, peer_of_rx, (1, 2), 8))
    tx.begin_batch([SendRequest(rid, peer_of_tx, (3, 4), (1, 2), 8)])
    for layer in range(SPEC.num_layers):
        tx.save_layer(layer)
    wait_until(lambda: tx.status(rid).state.finished and rx.status(rid).state.finished, 10.0, f"{rid} did not finish")


def test_a_stalled_pair_fails_only_that_pair(fake):
    npu = NpuPlatform()
    npu.set_thread_device(0)
    stage_stream = npu.new_stream()  # a worker's stream, held all along
    server = RendezvousServer()
    tx = KVSender(PagedKVCache(SPEC, 8), npu, CFG)
    rx_a, rx_b = KVReceiver(PagedKVCache(SPEC, 8), npu, CFG), KVReceiver(PagedKVCache(SPEC, 8), npu, CFG)
    try:
        ra, rb = server.rendezvous("p0-a/g0"), server.rendezvous("p0-b/g0")
        pairs = [tx.connect("a", ra), rx_a.connect("p0", ra.for_peer()), tx.connect("b", rb), rx_b.connect("p0", rb.for_peer())]
        assert all(p.wait_ready(10) for p in pairs), [p.error for p in pairs]

        # Pair a stalls: P publishes the batch, then never sends a layer. D's receives are posted
        # and time out; D breaks the pair while they run.
        rx_a.expect(RecvRequest("stalled", "p0", (1, 2), 8))
        tx.begin_batch([SendRequest("stalled", "a", (3, 4), (1, 2), 8)])
        wait_until(lambda: rx_a.status("stalled").state.finished, 10.0, "the stalled transfer did not fail")
        assert rx_a.status("stalled").state is TransferState.FAILED and rx_a.pair_state("p0") is PairState.BROKEN
        destroys = fake.of("HcclCommDestroy")
        assert (1, HCCL_E_AGAIN) in [e[2:] for e in destroys]
        stuck_pg = pairs[1]._held[0]
        stuck = (stuck_pg.hccl_stream.device_index, stuck_pg.hccl_stream.stream_id)
        assert fake.stuck.held(*stuck)
        # ... and its stuck receive holds only HCCL's stream: none of ours.
        assert not npu.streams.holds(*stuck) and stage_stream.stream_id != stuck[1]
        assert stage_stream.waits_on == []

        tx.abort_batch("peer a stalled")  # P gives up the stalled batch on its side
        # Pair b, on the same processes, carries KV while pair a's receive is still stuck.
        _transfer(tx, rx_b, "after", "b", "p0")
        assert tx.status("after").state is rx_b.status("after").state is TransferState.DONE
        assert rx_b.pair_state("p0") is PairState.READY and fake.stuck.held(*stuck)
        # A second abort finds nothing to destroy (abortAndClearHcclComm cleared the map).
        pairs[1].interrupt()
        assert [e[2:] for e in fake.of("HcclCommDestroy") if e[2] == 1] == [(1, HCCL_E_AGAIN)]
        # At HCCL_EXEC_TIMEOUT the stuck receive fails (a device task exception) and frees its stream.
        wait_until(lambda: not fake.stuck.held(*stuck), EXEC_TIMEOUT_S + 5, "the stuck stream was not freed")
    finally:
        tx.close()
        rx_a.close()
        rx_b.close()
        server.close()
