"""The KV hop between tensor-parallel degrees (issue 48 item 3): a P instance of m ranks and a D
instance of n ranks, every rank a real gloo group member on loopback (threads of this process
stand for the ranks' processes; the engine-level tests run them as processes).

Each P rank's cache holds its own KV heads of a model-wide KV filled from one seed; after a batch,
every D rank's blocks must hold exactly its heads of that KV, bit for bit, for every (m, n) in
{1, 2, 4}² with two KV heads (so a TP4 side replicates each head on two ranks), and the KV bytes
sent must equal the bytes D's heads need. A link that sends fewer bytes than its heads need fails
the request (retryable), and the pair carries the next batch exactly.
"""
from __future__ import annotations

import dataclasses

import pytest
import torch

from epdserve.engine.kv_cache import KVCacheSpec, PagedKVCache
from epdserve.kv_layout import rank_kv_heads
from epdserve.platform import get_platform
from epdserve.transfer.kv import KVReceiver, KVSender, KVTransferConfig, RecvRequest, RendezvousServer, SendRequest, TransferState
from epdserve.transfer.kv.links import KvShare, group_peers, hop_links, links_into
from tests.transfer.test_kv_protocol import wait_finished

KVH, LAYERS, HEAD_DIM, BLOCK = 2, 3, 8, 4
CFG = KVTransferConfig(timeout_s=10.0, bootstrap_timeout_s=20.0, connect_timeout_s=30.0)
PAIRS = [(m, n) for m in (1, 2, 4) for n in (1, 2, 4)]


def _spec(heads: int) -> KVCacheSpec:
    return KVCacheSpec(num_layers=LAYERS, num_kv_heads=heads, head_dim=HEAD_DIM, block_size=BLOCK, dtype=torch.bfloat16)


def _model_kv(seed: int, layer: int, blocks: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The model-wide K and V (every head) of `blocks` blocks of one layer."""
    g = torch.Generator().manual_seed(seed * 131 + layer)
    shape = (blocks, BLOCK, KVH, HEAD_DIM)
    return torch.randn(shape, generator=g).bfloat16(), torch.randn(shape, generator=g).bfloat16()


@pytest.mark.parametrize("kvh", [1, 2, 4, 8])
@pytest.mark.parametrize("m, n", PAIRS)
def test_every_decode_head_comes_once_from_a_prefill_rank_holding_it(m, n, kvh):
    links = hop_links(kvh, m, n)
    for s in range(n):
        got = [h for link in links_into(links, s) for h in link.heads]
        assert got == list(rank_kv_heads(kvh, n, s))  # exactly its heads, each once, in order
    for link in links:
        assert set(link.heads) <= set(rank_kv_heads(kvh, m, link.p_rank))
    assert sum(len(link.heads) for link in links) == sum(len(rank_kv_heads(kvh, n, s)) for s in range(n))
    if m > kvh and n >= m:  # replicated on P: the replicas take turns, so every P rank sends
        assert {link.p_rank for link in links} == set(range(m))
    for rank in range(m + n):  # P ranks never talk to each other; every D rank talks to D rank 0
        peers = group_peers(m, n, links, rank)
        assert rank not in peers and (rank >= m or all(p >= m for p in peers))


class Hop:
    """m prefill ranks and n decode ranks, each with its own cache and endpoint, in one pair."""

    def __init__(self, m: int, n: int, sender_cls=KVSender, pair_name: str = "p0>d0/g0", cfg: KVTransferConfig = CFG):
        cpu = get_platform("cpu")
        self.m, self.n = m, n
        self.server = RendezvousServer()
        self.p_caches = [PagedKVCache(_spec(len(rank_kv_heads(KVH, m, r))), 16) for r in range(m)]
        self.d_caches = [PagedKVCache(_spec(len(rank_kv_heads(KVH, n, s))), 16) for s in range(n)]
        self.senders = [sender_cls(c, cpu, cfg, KvShare(KVH, m, r)) for r, c in enumerate(self.p_caches)]
        self.receivers = [KVReceiver(c, cpu, cfg, KvShare(KVH, n, s)) for s, c in enumerate(self.d_caches)]
        base = self.server.rendezvous(pair_name)
        rdzv = type(base)(base.host, base.port, base.pair_name, 0, m, n)
        pairs = [tx.connect("d0", rdzv.for_rank(r)) for r, tx in enumerate(self.senders)]
        pairs += [rx.connect("p0", rdzv.for_rank(m + s)) for s, rx in enumerate(self.receivers)]
        if not all(p.wait_ready(60) for p in pairs):
            raise RuntimeError(f"pair not built: {[p.error for p in pairs]}")

    def batch(self, rid: str, src: tuple[int, ...], dst: tuple[int, ...], tokens: int, seed: int) -> None:
        """D reserves `dst`, P's ranks write their heads of the model KV into `src` and send."""
        self.receivers[0].expect(RecvRequest(rid, "p0", dst, tokens))
        opened = self.senders[0].begin_batch([SendRequest(rid, "d0", src, dst, tokens)])
        for tx in self.senders[1:]:
            tx.follow(opened)
        for layer in range(LAYERS):
            k, v = _model_kv(seed, layer, len(src))
            for r, (tx, cache) in enumerate(zip(self.senders, self.p_caches)):
                heads = rank_kv_heads(KVH, self.m, r)
                cache.write_blocks(layer, list(src), k[:, :, heads.start:heads.stop], v[:, :, heads.start:heads.stop])
                tx.save_layer(layer)

    def decode_holds(self, dst: tuple[int, ...], seed: int) -> bool:
        for layer in range(LAYERS):
            k, v = _model_kv(seed, layer, len(dst))
            for s, cache in enumerate(self.d_caches):
                heads = rank_kv_heads(KVH, self.n, s)
                got_k, got_v = cache.read_blocks(layer, list(dst))
                if not (torch.equal(got_k, k[:, :, heads.start:heads.stop]) and
                        torch.equal(got_v, v[:, :, heads.start:heads.stop])):
                    return False
        return True

    def close(self) -> None:
        for e in self.senders + self.receivers:
            e.close()
        self.server.close()


def _finished(side, rid: str):
    return wait_finished(side, {rid}, timeout_s=30.0)[rid]


@pytest.mark.parametrize("m, n, hop_kind", [(m, n, "device") for m, n in PAIRS] + [(2, 1, "host"), (1, 4, "host")])
def test_each_decode_rank_gets_exactly_its_heads_for_every_pair_of_degrees(m, n, hop_kind):
    """`hop_kind` "host": every message staged through host buffers (a P and a D on one accelerator)."""
    hop = Hop(m, n, cfg=dataclasses.replace(CFG, hop=hop_kind))
    try:
        src, dst, tokens = (3, 0, 7), (9, 10, 2), 11  # non-contiguous on both sides: two chunks on D
        hop.batch("r", src, dst, tokens, seed=5)
        st_d, st_p = _finished(hop.receivers[0], "r"), _finished(hop.senders[0], "r")
        assert st_d.state is st_p.state is TransferState.DONE, (st_d.error, st_p.error)
        assert hop.decode_holds(dst, seed=5)
        ideal = sum(len(dst) * c.spec.bytes_per_block() for c in hop.d_caches)  # every layer's K and V
        assert sum(tx.bytes_sent for tx in hop.senders) == ideal  # the D heads' bytes, no more
    finally:
        hop.close()


class ShortSender(KVSender):
    """A prefill rank whose messages lose their last head_dim elements while `short` is set."""

    short = False

    def _message(self, blocks, offset, num_heads):
        msg = super()._message(blocks, offset, num_heads)
        return msg.reshape(-1)[:-HEAD_DIM] if self.short else msg


def test_a_link_that_sends_fewer_bytes_than_its_heads_need_fails_the_request_and_the_retry_is_exact():
    hop = Hop(2, 2, sender_cls=ShortSender)  # links P0 -> D0 (head 0) and P1 -> D1 (head 1)
    try:
        for short_rank, why in ((1, "D rank 1 did not get every byte"), (0, "P rank 0 sent")):
            hop.senders[short_rank].short = True
            rid = f"short{short_rank}"
            hop.batch(rid, (1, 2), (4, 5), 6, seed=1)
            st_d, st_p = _finished(hop.receivers[0], rid), _finished(hop.senders[0], rid)
            assert st_d.state is st_p.state is TransferState.FAILED, (st_d, st_p)
            assert "incomplete KV" in st_d.error and why in st_d.error, st_d.error
            hop.senders[short_rank].short = False
        hop.batch("retry", (1, 2), (4, 5), 6, seed=1)  # the retry, on the same pair
        assert _finished(hop.receivers[0], "retry").state is _finished(hop.senders[0], "retry").state \
            is TransferState.DONE
        assert hop.decode_holds((4, 5), seed=1)
    finally:
        hop.close()
