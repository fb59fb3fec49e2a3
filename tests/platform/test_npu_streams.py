"""Our NPU streams against the fake's model of torch_npu's stream pools (tests/fakes/
npu_stream_pool.py): `torch.npu.Stream()` aliases after 32, ours never alias each other, and HCCL's
communicator stream (drawn from pool 0 by ProcessGroupHCCL) is never one of ours."""
from __future__ import annotations

import threading
from datetime import timedelta

import pytest
import torch
from torch.distributed import HashStore

from epdserve.platform.npu import NpuPlatform
from epdserve.platform.npu_streams import STREAMS_PER_POOL, StreamsExhausted
from tests.fakes.torch_npu_fake import FakeTorchNpu


def test_the_fake_pool_is_torch_npus(monkeypatch):
    FakeTorchNpu().install(monkeypatch)
    first = [torch.npu.Stream() for _ in range(STREAMS_PER_POOL)]
    assert len({s.stream_id for s in first}) == STREAMS_PER_POOL
    again = torch.npu.Stream()  # round-robin: the 33rd is the 1st (NPUStream.cpp get_idx)
    assert again == first[0] and again is not first[0]
    high = torch.npu.Stream(priority=-5)  # clamp(-priority, 0, 1): pool 1
    assert high.stream_id >> 5 == 4 and first[0].stream_id >> 5 == 3
    with pytest.raises(RuntimeError, match="get_priority"):
        high.priority


def test_our_streams_never_alias_each_other(monkeypatch):
    FakeTorchNpu().install(monkeypatch)
    npu = NpuPlatform()
    npu.set_thread_device(0)
    ours = [npu.new_stream() for _ in range(STREAMS_PER_POOL)]
    assert len({s.stream_id for s in ours}) == STREAMS_PER_POOL
    with pytest.raises(StreamsExhausted):
        npu.new_stream()
    npu.release_stream(ours[7])
    assert npu.new_stream() == ours[7]  # a stream given back is the one handed out next


def test_streams_drawn_by_others_are_skipped(monkeypatch):
    FakeTorchNpu().install(monkeypatch)
    npu = NpuPlatform()
    npu.set_thread_device(0)
    a = npu.new_stream()
    for _ in range(STREAMS_PER_POOL - 1):  # someone else draws from pool 1: the counter wraps onto `a`
        torch.npu.Stream(priority=-1)
    b = npu.new_stream()
    assert b != a


def _pair_groups(npu) -> dict:
    """Both ranks of one HCCL pair group, each built and handshaken in its own thread."""
    store, pgs = HashStore(), {}

    def side(rank):
        npu.set_thread_device(0)
        pg = npu.make_pair_group(store, rank, 2, timedelta(seconds=10), group_name="g")
        (pg.send if rank == 0 else pg.recv)([torch.ones(1, dtype=torch.uint8)], 1 - rank, 0)
        pgs[rank] = pg

    threads = [threading.Thread(target=side, args=(r,)) for r in (0, 1)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(20)
    return pgs


@pytest.mark.parametrize("high", [None, "1"])
def test_hccl_streams_are_never_ours(high, monkeypatch):
    FakeTorchNpu().install(monkeypatch)
    monkeypatch.delenv("TORCH_HCCL_HIGH_PRIORITY", raising=False)
    if high:  # the operator forces HCCL onto pool 1, ours: the pair sees it
        monkeypatch.setenv("TORCH_HCCL_HIGH_PRIORITY", high)
    npu = NpuPlatform()
    npu.set_thread_device(0)
    ours = {npu.new_stream().stream_id for _ in range(STREAMS_PER_POOL)}
    pgs = _pair_groups(npu)
    hccl = {pg._get_stream_id(True, 1 - r) for r, pg in pgs.items()}
    conflicts = [npu.pair_stream_conflict(pg, 1 - r) for r, pg in pgs.items()]
    if high:
        assert hccl <= ours and all("TORCH_HCCL_HIGH_PRIORITY" in c for c in conflicts)
    else:
        assert -1 not in hccl and not hccl & ours and conflicts == [None, None]
    for pg in pgs.values():
        pg.abort_hccl_comm()
