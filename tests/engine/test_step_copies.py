"""The step's host→device copies under the NPU copy model of tests/fakes/host_reads.py (torch_npu's
CopyKernelOpApi.cpp: a blocking or pageable host→device copy synchronizes the stream, a
non_blocking one from pinned memory does not): `StepBuffers` uploads a step's integers with one
pinned non-blocking copy through two alternating host buffers, and the engine step's budget is one
such upload and one read of the sampled tokens (issue 36 item 2)."""
from __future__ import annotations

import pytest
import torch

from tests.engine.test_step_host_reads import _runner, _seq  # the step harness (imports transformers first)
from epdserve.engine.step_contract import ScheduledStep
from epdserve.engine.step_buffers import StepBuffers
from epdserve.ops.attention_meta import StepPacker
from epdserve.ops.portable import PortableOps
from epdserve.platform.cpu import CpuPlatform
from tests.fakes.host_reads import HostReads

DEV = "cpu"  # the stand-in device: what an upload names


def _packed(*parts: list[int]) -> StepPacker:
    packer = StepPacker()
    for values in parts:
        packer.add(values, torch.int64)
    return packer


def _bytes(values: list[int]) -> torch.Tensor:
    return torch.frombuffer(_packed(values).buf, dtype=torch.uint8)


def _stage(capacity: int = 1 << 16) -> StepBuffers:
    """`StepBuffers` on its accelerator path (pinned host buffers, one non-blocking copy) on the
    stand-in device; allocated lazily at the first upload, so inside the counter, which is where
    the stand-in can pin (tests/fakes/host_reads.py)."""
    return StepBuffers(torch.device(DEV), CpuPlatform(), capacity=capacity, stage=True)


def test_an_upload_is_one_pinned_non_blocking_copy_and_no_sync():
    bufs, copies = _stage(), HostReads()
    with copies:
        views = bufs.upload(_packed([1, 2, 3], [7] * 5))
    assert copies.counts() == {"h2d": 1, "d2h": 0, "syncs": 0}, copies.copies
    assert copies.copies[0].pinned and copies.copies[0].non_blocking and copies.copies[0].call == "copy_"
    assert [v.tolist() for v in views] == [[1, 2, 3], [7] * 5]


def test_steps_alternate_two_host_buffers_over_one_device_buffer():
    """Step k+1 packs into the other host buffer: step k's bytes stay where its copy reads them."""
    bufs, copies = _stage(), HostReads()
    with copies:
        first = bufs.upload(_packed([1, 2]))
        host_first = bufs._host[0][:16].clone()
        second = bufs.upload(_packed([3, 4]))
        third = bufs.upload(_packed([5, 6]))
    assert copies.counts() == {"h2d": 3, "d2h": 0, "syncs": 0}
    assert torch.equal(host_first, _bytes([1, 2])) and torch.equal(bufs._host[0][:16], _bytes([5, 6]))
    assert torch.equal(bufs._host[1][:16], _bytes([3, 4]))  # the third step packed into the other one
    assert first[0].untyped_storage().data_ptr() == second[0].untyped_storage().data_ptr() == third[0].untyped_storage().data_ptr()
    assert third[0].tolist() == [5, 6]


def test_a_step_larger_than_the_buffers_grows_them_and_still_copies_once():
    bufs, copies = _stage(capacity=16), HostReads()
    with copies:
        bufs.upload(_packed([1, 2]))
        big = bufs.upload(_packed(list(range(100))))
    assert bufs.capacity >= 800
    assert copies.counts() == {"h2d": 2, "d2h": 0, "syncs": 0}
    assert big[0].tolist() == list(range(100))


def test_on_the_cpu_nothing_is_copied_and_a_dest_gets_the_bytes():
    bufs, copies = StepBuffers(torch.device("cpu"), CpuPlatform()), HostReads()
    dest = torch.zeros(64, dtype=torch.uint8)
    with copies:
        views = bufs.upload(_packed([4, 5, 6]))
        into = bufs.upload(_packed([8, 9]), dest=dest)
    assert copies.counts() == {"h2d": 0, "d2h": 0, "syncs": 0} and bufs.capacity == 0
    assert views[0].tolist() == [4, 5, 6] and into[0].tolist() == [8, 9] and dest[:16].view(torch.int64).tolist() == [8, 9]


def _decode_step_counts(mixed: bool = False) -> tuple[dict, list]:
    """Copies of one step on the stand-in, the runner's buffers on the accelerator path (pinned
    host buffers, one non-blocking upload): a decode step of two requests, or (mixed) one of a
    decode and a prompt."""
    runner = _runner(2, PortableOps())
    seqs = [_seq(1, 5), _seq(2, 9)]
    out = runner.execute(ScheduledStep.of([(s, 0, s.prompt_len, (k,)) for k, s in enumerate(seqs)])).tokens
    for s, t in zip(seqs, out):
        s.output_token_ids.append(t)
        s.num_computed_tokens = s.prompt_len
    # the stand-in can pin only inside the counter (tests/fakes/host_reads.py): allocated there
    runner.buffers = StepBuffers(runner.device, runner.buffers.platform, stage=True)
    copies = HostReads()
    copies.mark(*runner.adapter.hf.parameters(), *runner.adapter.hf.buffers(), *runner.lm.tensors(),
                *runner.kv_cache.keys, *runner.kv_cache.values)
    items = [(s, s.prompt_len, 1, (k,)) for k, s in enumerate(seqs)]
    if mixed:
        fresh = _seq(3, 7)
        items.append((fresh, 0, fresh.prompt_len, (2,)))
    step = ScheduledStep.of(items)
    with copies:
        runner.execute(step)  # allocates the pinned and device buffers, then uploads
        runner.execute(step)  # the same step again: the buffers are reused
    return copies.counts(), copies.copies


@pytest.mark.parametrize("mixed", [False, True], ids=["decode", "decode+prompt"])
def test_a_step_uploads_once_and_reads_back_only_its_tokens(mixed):
    """Two steps counted: per step one pinned non-blocking upload (no sync), one read of the
    sampled tokens (a d2h, a sync) — whatever the step holds."""
    counts, copies = _decode_step_counts(mixed)
    print(f"two steps on the stand-in: {counts}; {[(c.call, c.direction, c.pinned, c.where) for c in copies]}")
    assert counts == {"h2d": 2, "d2h": 2, "syncs": 2}, copies
    assert all(c.pinned and c.non_blocking for c in copies if c.direction == "h2d")
