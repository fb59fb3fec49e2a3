"""KV hop messages and wire layout: JSON round trips, malformed input, chunking, byte views."""
from __future__ import annotations

import pytest
import torch

from epdserve.engine.kv_cache import KVCacheSpec, PagedKVCache
from epdserve.transfer.kv import BatchHeader, KVTransferConfig, PairRendezvous, RequestEntry
from epdserve.transfer.kv.layout import Chunk, as_bytes, contiguous_runs, layer_plan, select_blocks
from epdserve.transfer.kv.links import KvShare

SPEC = KVCacheSpec(num_layers=2, num_kv_heads=2, head_dim=4, block_size=4, dtype=torch.bfloat16)


def test_rendezvous_round_trips_and_flips_rank():
    r = PairRendezvous("10.0.0.5", 41000, "p0-d1/g2", 0)
    assert PairRendezvous.from_json(r.to_json()) == r
    assert r.for_peer() == PairRendezvous("10.0.0.5", 41000, "p0-d1/g2", 1)


@pytest.mark.parametrize("text, match", [
    ('{"host": "h", "port": 0, "pair_name": "x", "rank": 0}', "port"),
    ('{"host": "h", "port": 5, "pair_name": "x", "rank": 2}', "rank"),
    ('{"host": "h", "port": 5, "pair_name": "", "rank": 0}', "pair_name"),
    ('{"host": "h", "port": 5, "pair_name": "x"}', "fields"),
    ("not json", "not JSON"),
])
def test_rendezvous_rejects_malformed(text, match):
    with pytest.raises(ValueError, match=match):
        PairRendezvous.from_json(text)


def test_header_round_trips_and_checks_the_cache_shape():
    h = BatchHeader.for_spec(SPEC, 3, [RequestEntry("a", 9, (4, 5, 9)), RequestEntry("b", 1, (0,))])
    assert BatchHeader.from_json(h.to_json()) == h
    assert h.dtype == "bfloat16" and h.block_bytes(2) == 4 * 2 * 4 * 2
    assert (h.p_degree, h.d_degree, h.num_kv_heads) == (1, 1, 2)
    assert h.spec_mismatch(SPEC, KvShare(2)) is None
    other = KVCacheSpec(2, 2, 8, 4, torch.bfloat16)
    assert "head_dim" in h.spec_mismatch(other, KvShare(2))
    assert "D degree" in h.spec_mismatch(SPEC, KvShare(4, 2, 1))  # a TP2 rank cannot take a batch sent to TP1
    tp = BatchHeader.for_spec(SPEC, 0, [RequestEntry("a", 9, (4, 5, 9))], KvShare(4, 2, 0), d_degree=2)
    assert (tp.num_kv_heads, tp.p_degree, tp.d_degree) == (4, 2, 2) and tp.spec_mismatch(SPEC, KvShare(4, 2, 1)) is None
    small = KVCacheSpec(2, 1, 4, 4, torch.bfloat16)  # a cache holding 1 head where its share is 2
    assert "holds 1 KV heads" in tp.spec_mismatch(small, KvShare(4, 2, 1))


@pytest.mark.parametrize("change, match", [
    (dict(requests=[{"request_id": "a", "num_tokens": 9, "dst_block_ids": [1]}]), "need 3 blocks"),
    (dict(requests=[{"request_id": "a", "num_tokens": 2, "dst_block_ids": [1]}] * 2), "repeats"),
    (dict(requests=[{"request_id": "a", "num_tokens": 2, "dst_block_ids": [-1]}]), "block ids"),
    (dict(requests=[]), "empty"),
    (dict(dtype="int8"), "dtype"),
    (dict(num_layers=0), "num_layers"),
    (dict(d_degree=0), "d_degree"),
    (dict(p_degree=65), "p_degree"),
    (dict(extra=1), "fields"),
])
def test_header_rejects_malformed(change, match):
    import json

    d = json.loads(BatchHeader.for_spec(SPEC, 0, [RequestEntry("a", 9, (1, 2, 3))]).to_json())
    d.update(change)
    with pytest.raises(ValueError, match=match):
        BatchHeader.from_json(json.dumps(d))


def test_runs_and_plan_follow_the_decode_side_blocks():
    assert contiguous_runs([3, 4, 5, 9, 10, 2]) == [(0, 3), (3, 2), (5, 1)]
    assert contiguous_runs([]) == []
    assert layer_plan([(7, 8), (1, 3)]) == [Chunk(0, 0, 2), Chunk(1, 0, 1), Chunk(1, 1, 1)]


def test_select_blocks_views_consecutive_blocks_and_copies_scattered_ones():
    cache = PagedKVCache(SPEC, 8)
    cache.keys[0].normal_()
    view = select_blocks(cache.keys[0], [2, 3, 4])
    assert view.data_ptr() == cache.keys[0][2].data_ptr()
    copy = select_blocks(cache.keys[0], [5, 1])
    assert torch.equal(copy, cache.keys[0][[5, 1]]) and copy.data_ptr() != cache.keys[0][5].data_ptr()


def test_byte_view_writes_through_and_keeps_bf16_bits():
    t = torch.randn(3, 4).to(torch.bfloat16)
    b = as_bytes(t)
    assert b.dtype == torch.uint8 and b.numel() == 24
    target = torch.zeros(3, 4, dtype=torch.bfloat16)
    as_bytes(target).copy_(b)
    assert torch.equal(target.view(torch.int16), t.view(torch.int16))
    with pytest.raises(ValueError, match="contiguous"):
        as_bytes(t.t())


def test_config_rejects_non_positive_timeouts():
    with pytest.raises(ValueError, match="timeout_s"):
        KVTransferConfig(timeout_s=0)
