"""The NPU copy model of tests/fakes/host_reads.py (torch_npu's CopyKernelOpApi.cpp: a blocking
or pageable host→device copy synchronizes the stream, a non_blocking one from pinned memory does
not), and the engine step's budget under it: one pinned non-blocking upload and one read of the
sampled tokens (issue 36 item 2)."""
from __future__ import annotations

import pytest
import torch

from tests.engine.test_step_host_reads import _runner, _seq  # the step harness (imports transformers first)
from epdserve.engine.scheduler import ScheduledSeq
from epdserve.engine.step_buffers import StepBuffers
from epdserve.ops.portable import PortableOps
from tests.fakes.host_reads import HostReads

DEV = "cpu"  # the stand-in device: what an upload names


def test_a_blocking_host_to_device_copy_is_a_sync():
    copies = HostReads()
    with copies:
        torch.zeros(4).to(DEV)  # non_blocking=False: aclrtSynchronizeStream before the memcpy
    assert copies.counts() == {"h2d": 1, "d2h": 0, "syncs": 1}


def test_a_non_blocking_copy_from_pageable_memory_is_a_sync():
    copies = HostReads()
    with copies:
        torch.zeros(4).to(DEV, non_blocking=True)  # malloc'd memory: process_unregistered_mem_location_type
    assert copies.counts() == {"h2d": 1, "d2h": 0, "syncs": 1}


def test_a_non_blocking_copy_from_pinned_memory_is_not_a_sync():
    copies = HostReads()
    with copies:
        staged = torch.empty(4, pin_memory=True)
        staged.copy_(torch.arange(4.0))  # host to host: no copy to count
        staged.to(DEV, non_blocking=True)
        pinned = torch.ones(3).pin_memory()
        resident = torch.empty(3, device=DEV)  # no data: nothing copied
        resident.copy_(pinned, non_blocking=True)
    assert copies.counts() == {"h2d": 2, "d2h": 0, "syncs": 0}
    assert all(c.pinned and c.non_blocking for c in copies.copies)


def test_a_factory_with_data_copies_blocking_and_a_value_read_is_a_blocking_d2h():
    copies = HostReads()
    with copies:
        t = torch.tensor([1, 2, 3], device=DEV)  # tensor_new.cpp: built on the host, copied non_blocking=False
        t.tolist()
        t.cpu()
    assert copies.counts() == {"h2d": 1, "d2h": 2, "syncs": 3}
    assert [c.call for c in copies.copies] == ["tensor", "tolist", "cpu"]


def test_a_copy_into_a_resident_tensor_from_pageable_memory_is_a_sync():
    copies = HostReads()
    with copies:
        resident = torch.empty(3, device=DEV)
        resident.copy_(torch.ones(3), non_blocking=True)
    assert copies.counts() == {"h2d": 1, "d2h": 0, "syncs": 1}


def _decode_step_counts(mixed: bool = False) -> tuple[dict, list]:
    """Copies of one step on the stand-in, the runner's buffers on the accelerator path (pinned
    host buffers, one non-blocking upload): a decode step of two requests, or (mixed) one of a
    decode and a prompt."""
    runner = _runner(2, PortableOps())
    seqs = [_seq(1, 5), _seq(2, 9)]
    out = runner.execute([ScheduledSeq(s, 0, s.prompt_len, (k,)) for k, s in enumerate(seqs)])
    for s, t in zip(seqs, out):
        s.output_token_ids.append(t)
        s.num_computed_tokens = s.prompt_len
    # the stand-in can pin only inside the counter (tests/fakes/host_reads.py): allocated there
    runner.buffers = StepBuffers(runner.device, runner.buffers.platform, stage=True)
    copies = HostReads()
    copies.mark(*runner.adapter.hf.parameters(), *runner.adapter.hf.buffers(), *runner.lm.tensors(),
                *runner.kv_cache.keys, *runner.kv_cache.values)
    items = [ScheduledSeq(s, s.prompt_len, 1, (k,)) for k, s in enumerate(seqs)]
    if mixed:
        fresh = _seq(3, 7)
        items.append(ScheduledSeq(fresh, 0, fresh.prompt_len, (2,)))
    with copies:
        runner.execute(items)  # allocates the pinned and device buffers, then uploads
        runner.execute(items)  # the same step again: the buffers are reused
    return copies.counts(), copies.copies


@pytest.mark.parametrize("mixed", [False, True], ids=["decode", "decode+prompt"])
def test_a_step_uploads_once_and_reads_back_only_its_tokens(mixed):
    """Two steps counted: per step one pinned non-blocking upload (no sync), one read of the
    sampled tokens (a d2h, a sync) — whatever the step holds."""
    counts, copies = _decode_step_counts(mixed)
    print(f"two steps on the stand-in: {counts}; {[(c.call, c.direction, c.pinned, c.where) for c in copies]}")
    assert counts == {"h2d": 2, "d2h": 2, "syncs": 2}, copies
    assert all(c.pinned and c.non_blocking for c in copies if c.direction == "h2d")
