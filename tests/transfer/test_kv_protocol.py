"""KV hop protocol, both ends in one process over a real gloo pair on loopback.

Covers what needs no second process: bit-exact delivery into non-contiguous blocks, several
batches in flight, rejection (unexpected request, wrong blocks) without losing step with the
sender, cancel, bootstrap expiry, abort midway, and input validation.
"""
from __future__ import annotations

import time

import pytest
import torch

from epdserve.engine.block_manager import BlockManager
from epdserve.engine.kv_cache import KVCacheSpec, PagedKVCache
from epdserve.platform import get_platform
from epdserve.transfer.kv import (
    KVReceiver, KVSender, KVTransferConfig, PairState, RecvRequest, RendezvousServer, SendRequest, TransferState,
)
from epdserve.transfer.kv.checks import blocks_digest, fill_random

SPEC = KVCacheSpec(num_layers=3, num_kv_heads=2, head_dim=8, block_size=4, dtype=torch.bfloat16)
CFG = KVTransferConfig(timeout_s=5.0, bootstrap_timeout_s=5.0, connect_timeout_s=20.0)


class Ends:
    """A prefill end and a decode end joined by one pair."""

    def __init__(self, cfg: KVTransferConfig = CFG, d_spec: KVCacheSpec = SPEC, pair_name: str = "p0-d0/g0"):
        cpu = get_platform("cpu")
        self.server = RendezvousServer()
        self.p_cache, self.d_cache = PagedKVCache(SPEC, 16), PagedKVCache(d_spec, 16)
        self.sender, self.receiver = KVSender(self.p_cache, cpu, cfg), KVReceiver(self.d_cache, cpu, cfg)
        rdzv = self.server.rendezvous(pair_name)
        p_pair = self.sender.connect("d0", rdzv)
        d_pair = self.receiver.connect("p0", rdzv.for_peer())
        if not (p_pair.wait_ready(30) and d_pair.wait_ready(30)):
            raise RuntimeError(f"pair not built: {p_pair.error} / {d_pair.error}")

    def prefill(self, reqs: list[SendRequest], seed: int = 0, stop_after: int | None = None) -> None:
        """Simulate a forward: write each layer's KV, then hand it to the sender."""
        self.sender.begin_batch(reqs)
        for layer in range(SPEC.num_layers):
            for r in reqs:
                fill_random(self.p_cache, layer, r.src_block_ids, seed + hash(r.request_id) % 1000)
            if stop_after is not None and layer == stop_after:
                return
            self.sender.save_layer(layer)

    def close(self) -> None:
        self.sender.close()
        self.receiver.close()
        self.server.close()


def wait_finished(side, ids: set[str], timeout_s: float = 15.0) -> dict:
    """Poll like an engine loop until every id in `ids` finished; bounded."""
    out: dict = {}
    deadline = time.monotonic() + timeout_s
    while set(out) != ids:
        for st in side.pop_finished():
            out[st.request_id] = st
        if time.monotonic() > deadline:
            raise AssertionError(f"not finished within {timeout_s}s: {ids - set(out)}; got {out}")
        time.sleep(0.005)
    return out


@pytest.fixture
def ends():
    e = Ends()
    yield e
    e.close()


def test_layers_land_bit_exact_in_reserved_blocks(ends):
    reqs = [
        SendRequest("a", "d0", src_block_ids=(9, 2, 5), dst_block_ids=(3, 4, 11), num_tokens=10),
        SendRequest("b", "d0", src_block_ids=(0,), dst_block_ids=(7,), num_tokens=4),
    ]
    for r in reqs:
        ends.receiver.expect(RecvRequest(r.request_id, "p0", r.dst_block_ids, r.num_tokens))
    assert ends.receiver.status("a").state is TransferState.BOOTSTRAPPING
    ends.prefill(reqs)
    p = wait_finished(ends.sender, {"a", "b"})
    d = wait_finished(ends.receiver, {"a", "b"})
    for r in reqs:
        assert p[r.request_id].state is TransferState.DONE and d[r.request_id].state is TransferState.DONE
        assert d[r.request_id].layers_done == SPEC.num_layers
        assert blocks_digest(ends.d_cache, r.dst_block_ids) == blocks_digest(ends.p_cache, r.src_block_ids)


def test_batches_back_to_back_and_rejections_keep_the_stream_in_step(ends):
    rx = ends.receiver
    rx.expect(RecvRequest("x1", "p0", (1, 2), 8))
    rx.expect(RecvRequest("bad-blocks", "p0", (5,), 3))
    ends.prefill([SendRequest("x1", "d0", (4, 5), (1, 2), 8),
                  SendRequest("unexpected", "d0", (6,), (9,), 2),
                  SendRequest("bad-blocks", "d0", (7,), (6,), 3)])
    rx.expect(RecvRequest("x2", "p0", (12,), 4))
    ends.prefill([SendRequest("x2", "d0", (8,), (12,), 4)], seed=7)  # while batch 0's ack may be pending
    p = wait_finished(ends.sender, {"x1", "unexpected", "bad-blocks", "x2"})
    d = wait_finished(rx, {"x1", "bad-blocks", "x2"})
    assert p["x1"].state is p["x2"].state is TransferState.DONE
    assert p["unexpected"].state is TransferState.FAILED and "rejected" in p["unexpected"].error
    assert p["bad-blocks"].state is TransferState.FAILED
    assert d["bad-blocks"].state is TransferState.FAILED and "reserved [5]" in d["bad-blocks"].error
    assert blocks_digest(ends.d_cache, (12,)) == blocks_digest(ends.p_cache, (8,))
    assert blocks_digest(ends.d_cache, (1, 2)) == blocks_digest(ends.p_cache, (4, 5))
    assert ends.d_cache.keys[0][9].abs().sum() == 0  # the unexpected request went to scratch
    assert rx.pair_state("p0") is PairState.READY


def test_cancel_and_bootstrap_expiry_fail_only_that_request():
    e = Ends(KVTransferConfig(timeout_s=5.0, bootstrap_timeout_s=0.3, connect_timeout_s=20.0))
    try:
        e.receiver.expect(RecvRequest("late", "p0", (0,), 4))
        e.receiver.expect(RecvRequest("gone", "p0", (1,), 4))
        assert e.receiver.cancel("gone") is True
        d = wait_finished(e.receiver, {"late"})
        assert d["late"].state is TransferState.FAILED and "within 0.3 s" in d["late"].error
        assert e.receiver.pair_state("p0") is PairState.READY
        e.receiver.expect(RecvRequest("ok", "p0", (2,), 4))
        e.prefill([SendRequest("gone", "d0", (3,), (1,), 4), SendRequest("ok", "d0", (4,), (2,), 4)])
        p = wait_finished(e.sender, {"gone", "ok"})
        assert p["gone"].state is TransferState.FAILED and p["ok"].state is TransferState.DONE
        assert wait_finished(e.receiver, {"ok"})["ok"].state is TransferState.DONE
    finally:
        e.close()


def test_abort_midway_fails_both_sides_and_frees_blocks(ends):
    p_blocks, d_blocks = BlockManager(16, SPEC.block_size), BlockManager(16, SPEC.block_size)
    src = tuple(p_blocks.grow("r", 9))
    dst = tuple(d_blocks.grow("r", 9))
    ends.receiver.expect(RecvRequest("r", "p0", dst, 9))
    ends.prefill([SendRequest("r", "d0", src, dst, 9)], stop_after=1)  # layer 0 sent, then the forward dies
    ends.sender.abort_batch("forward raised")
    p = wait_finished(ends.sender, {"r"})
    d = wait_finished(ends.receiver, {"r"})
    assert p["r"].state is d["r"].state is TransferState.FAILED
    assert "forward raised" in p["r"].error
    p_blocks.free("r")
    d_blocks.free("r")
    assert p_blocks.num_free == d_blocks.num_free == 16
    assert ends.sender.pair_state("d0") is ends.receiver.pair_state("p0") is PairState.BROKEN


def test_shape_mismatch_is_rejected_by_the_decode_side():
    e = Ends(d_spec=KVCacheSpec(3, 2, 16, 4, torch.bfloat16))
    try:
        e.receiver.expect(RecvRequest("r", "p0", (0,), 4))
        e.prefill([SendRequest("r", "d0", (1,), (0,), 4)])
        assert wait_finished(e.sender, {"r"})["r"].state is TransferState.FAILED
        d = wait_finished(e.receiver, {"r"})["r"]
        assert d.state is TransferState.FAILED and "shape differs" in d.error
    finally:
        e.close()


def test_unknown_peer_fails_at_once_and_bad_input_raises(ends):
    ends.sender.begin_batch([SendRequest("n", "nobody", (0,), (0,), 4)])
    assert ends.sender.status("n").state is TransferState.FAILED
    ends.receiver.expect(RecvRequest("m", "nobody", (0,), 4))
    assert ends.receiver.status("m").state is TransferState.FAILED
    with pytest.raises(ValueError, match="need 2 blocks"):
        ends.sender.begin_batch([SendRequest("q", "d0", (0,), (0,), 5)])
    with pytest.raises(ValueError, match="need 1 blocks"):
        ends.receiver.expect(RecvRequest("q", "p0", (0, 1), 4))
    ends.sender.begin_batch([SendRequest("s", "d0", (0,), (0,), 4)])
    with pytest.raises(ValueError, match="out of order"):
        ends.sender.save_layer(1)
    with pytest.raises(RuntimeError, match="previous batch"):
        ends.sender.begin_batch([SendRequest("t", "d0", (1,), (1,), 4)])
    with pytest.raises(ValueError, match="rank 0"):
        ends.sender.connect("d1", ends.server.rendezvous("x", rank=1))
