"""The step contract (engine/step_contract.py, issue 47 item 1): the plan is frozen, the runner
returns what it drew and assigns nothing on the requests, and a block copy's two blocks stay held
until the step that carries the copy has run."""
from __future__ import annotations

import copy
import dataclasses

import pytest
import torch
from transformers import AutoTokenizer

from tests.engine.test_step_host_reads import _runner  # the step harness (imports transformers first)
from epdserve.engine.block_manager import BlockManager
from epdserve.engine.sampling_params import SamplingParams
from epdserve.engine.scheduler import Scheduler, StepSchedulerConfig
from epdserve.engine.sequence import Sequence
from epdserve.engine.request_parts import ChoiceGroup
from epdserve.engine.step_contract import ScheduledStep, StepResult
from epdserve.engine.stop_checker import StopChecker
from epdserve.ops.portable import PortableOps

_SAMPLED_STATE = {"generator", "group"}  # the sampler draws from their generators: that state moves


def _request(rid: str, n_tokens: int, **params) -> Sequence:
    s = Sequence(rid, [(5 * len(rid) + 3 * j) % 1900 for j in range(n_tokens)], SamplingParams(**params))
    s.positions = torch.arange(n_tokens).expand(3, n_tokens)
    return s


def _snapshot(seq: Sequence) -> dict:
    return {k: (v.clone() if isinstance(v, torch.Tensor) else copy.deepcopy(v))
            for k, v in vars(seq).items() if k not in _SAMPLED_STATE}


def _same(a, b) -> bool:
    return torch.equal(a, b) if isinstance(a, torch.Tensor) else a == b


def test_the_runner_returns_its_draws_and_assigns_nothing_on_the_requests():
    runner = _runner(2, PortableOps())
    plain = _request("plain", 5)
    asks = _request("asks", 9, logprobs=2)
    group = _request("group", 7, n=2, seed=3, temperature=1.0)
    group.group = ChoiceGroup.of(3, 2, runner.device)
    chunk = _request("chunk", 12)  # a prompt chunk that ends before its prompt: samples nothing
    seqs = [plain, asks, group, chunk]
    before = [_snapshot(s) for s in seqs]
    step = ScheduledStep.of([(plain, 0, 5, (0,)), (asks, 0, 9, (1,)), (group, 0, 7, (2,)), (chunk, 0, 6, (3,))])
    assert [r.sample_row for r in step.rows] == [0, 1, 2, None]
    with pytest.raises(dataclasses.FrozenInstanceError):
        step.rows[0].start = 1  # type: ignore[misc]

    result = runner.execute(step)

    for seq, snap in zip(seqs, before):
        changed = [k for k, v in snap.items() if not _same(v, getattr(seq, k))]
        assert not changed, f"the runner assigned {changed} on request {seq.request_id}"
    assert all(isinstance(t, int) for t in result.tokens[:3]) and result.tokens[3] is None
    assert result.logprobs[1] is not None and len(result.logprobs[1].top_ids) == 2
    assert result.logprobs[0] is result.logprobs[2] is result.logprobs[3] is None
    assert result.choices[2] is not None and len(result.choices[2]) == 1  # choice 1 of the group
    assert result.choices[0] is result.choices[1] is result.choices[3] is None


@pytest.fixture(scope="module")
def stop_checker(qwen2_vl_tiny):
    return StopChecker(AutoTokenizer.from_pretrained(qwen2_vl_tiny), set(), max_model_len=1 << 10)


def test_a_forks_copy_holds_both_blocks_until_its_step_has_run(stop_checker):
    """A group of 2 whose prompt ends inside a block, both choices ending at their first token:
    the choice's copy of the prompt's partial block waits for the next step, and until that step
    ran neither block goes to anyone else, although both requests have freed them."""
    blocks = BlockManager(num_blocks=6, block_size=4)
    sched = Scheduler(StepSchedulerConfig(max_num_seqs=4, max_num_batched_tokens=64), blocks, stop_checker)
    parent = _request("p", 6, n=2, max_tokens=1)
    parent.group = ChoiceGroup.of(None, 2, "cpu")
    sched.add(parent)
    first = sched.schedule()
    partial = first.rows[0].block_ids[1]
    sched.update(first, StepResult((7,), (None,), (((8, None),),)))
    assert parent.state.done and sched.block_copies, "both choices ended at their first token, the copy pending"
    src, dst = sched.block_copies[0]
    assert src == partial and blocks.num_free == 6 - 2  # freed by both requests, held for the copy

    newcomer = _request("n", 16)  # wants every block it can get
    sched.add(newcomer)
    second = sched.schedule()
    assert second.block_copies == ((src, dst),)
    assert not {src, dst} & set(second.rows[0].block_ids), "a held block went to another request"
    sched.update(second, StepResult((None,), (None,), (None,)))
    assert not sched.block_copies and blocks.num_free == 6 - len(second.rows[0].block_ids)
