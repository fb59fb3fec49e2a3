"""The step-time budget (engine/step_budget.py): what it plans from measured costs, and that an
engine under it — prefill in budget-sized chunks, an image's vision tower a block per step while
others decode — still gives transformers' greedy tokens; an abort drops an encode in flight."""
import pytest

from epdserve.engine.config import EngineConfig
from epdserve.engine.llm_engine import LLMEngine
from epdserve.engine.sampling_params import SamplingParams
from epdserve.engine.step_budget import HEADROOM, UNLIMITED, LinearCost, StepBudget
from epdserve.model.demo_images import jpeg_bytes, procedural_image
from epdserve.model.reference import ReferenceGenerator
from tests.engine.test_encode_stage import _drain
from tests.harness import PH


def test_linear_cost_fits_a_line_and_waits_for_two_sizes():
    c = LinearCost()
    c.add(4, 0.024)
    assert c.fit() is None  # one size: nothing known yet
    c.add(4, 0.024)
    assert c.fit() is None
    for x in (1, 8, 100, 300):
        c.add(x, 0.02 + 0.001 * x)
    a, b = c.fit()
    assert a == pytest.approx(0.02, abs=1e-3) and b == pytest.approx(0.001, rel=0.05)


def _budget(a=0.02, b=0.001, slo=0.1):
    s = StepBudget(slo, min_prefill_tokens=16, bank=2.0)  # a small cap: the plans below reach it
    for x in (1, 2, 50, 200):
        s.record_step(x, a + b * x)
    return s


def test_work_conserving_without_decodes_or_costs():
    assert _budget().plan(0, 5000, 900) == UNLIMITED
    assert StepBudget(0.1).plan(8, 5000, 900) == UNLIMITED  # costs not measured yet


def test_prefill_and_vision_fill_what_the_decodes_leave():
    s = _budget()
    left = 0.1 * HEADROOM - (0.02 + 0.001 * 4)
    plan = s.plan(4, 30, 0)
    assert plan.prefill_tokens == int(left / 0.001) and plan.vision_blocks is None
    assert s.plan(4, 30, 100).vision_blocks == 1  # vision cost not measured yet: one block to learn it
    s.record_vision(100, 2, 0.002)  # 1e-5 s per patch-block
    blocks = s.plan(4, 30, 100).vision_blocks
    assert blocks == int((left - 30 * 0.001) / (1e-5 * 100))
    heavy = _budget(a=0.2)  # decodes alone overrun the SLO: still some progress
    assert heavy.plan(4, 30, 100).prefill_tokens == 16 and heavy.plan(4, 30, 100).vision_blocks == 1


def test_a_step_takes_the_least_slack_of_its_decodes():
    s = _budget()
    t = s.target_s
    assert s.step_target([], 5.0) == t  # nothing decoding: the SLO's share
    assert s.step_target([(0.0, 3)], 2 * t) == pytest.approx(2 * t)  # 4th token due at 4t
    assert s.step_target([(0.0, 3), (t, 0)], 1.5 * t) == pytest.approx(0.5 * t)  # the newer one is due first
    assert s.step_target([(0.0, 10)], t) == s.max_step_s  # much banked: at most `bank` targets
    assert s.step_target([(0.0, 0)], 2 * t) < 0  # late: its next token is overdue


def test_slack_is_counted_over_the_tokens_to_come():
    s = StepBudget(0.1, bank=30.0, horizon=32)
    t = s.target_s
    assert s.step_target([(0.0, 0, 32)], 0.0, decode_s=0.03) == pytest.approx(t + 31 * (t - 0.03))
    assert s.step_target([(0.0, 0, 4)], 0.0, decode_s=0.03) == pytest.approx(t + 3 * (t - 0.03))  # 4 to come
    assert s.step_target([(0.0, 0, 1)], 0.0, decode_s=0.03) == pytest.approx(t)  # its last token: no horizon
    assert s.step_target([(0.0, 0, 32)], 0.0) == pytest.approx(t)  # decode cost unknown: the next token only
    assert s.step_target([(0.0, 0, 32)], 0.0, decode_s=0.5) == pytest.approx(t)  # decodes alone overrun: no credit
    assert s.step_target([(0.0, 0, 500)], 0.0, decode_s=0.03) == pytest.approx(t + 31 * (t - 0.03))  # the horizon
    assert StepBudget(0.1, horizon=32, bank=2.0).step_target([(0.0, 0, 32)], 0.0, decode_s=0.03) == pytest.approx(
        2 * t)  # a bank of 2 caps it
    assert StepBudget(0.1, horizon=1).step_target([(0.0, 0, 32)], 0.0, decode_s=0.03) == pytest.approx(t)  # next only
    default = StepBudget(0.1)  # the defaults: a full horizon's slack, no lower cap
    assert (default.horizon, default.max_step_s) == (32, pytest.approx(32 * t))
    assert default.step_target([(0.0, 0, 32)], 0.0, decode_s=0.03) == pytest.approx(t + 31 * (t - 0.03))


def test_the_engine_counts_each_decodes_tokens_to_come(qwen2_vl_tiny):
    eng = LLMEngine(EngineConfig(model=str(qwen2_vl_tiny), device="cpu", slo_tpot_ms=100.0, step_budget_horizon=5))
    assert eng.budget.horizon == 5
    seen = []
    real = eng.budget.step_target
    eng.budget.step_target = lambda clocks, now, decode_s=None: seen.append(
        (clocks, decode_s, {r: len(q.output_token_ids) for r, q in eng._seqs.items()})) or real(clocks, now, decode_s)
    eng.add_request(eng.build_request("a", "a text prompt " * 8, None, SamplingParams(max_tokens=12, ignore_eos=True)))
    eng.add_request(eng.build_request("b", "another prompt " * 3, None, SamplingParams(max_tokens=7, ignore_eos=True)))
    for _ in range(5):
        eng.step()
    clocks, decode_s, made = seen[-1]  # the tokens each had made when the step was planned
    assert sorted(c[2] for c in clocks) == sorted([12 - made["a"], 7 - made["b"]])
    assert decode_s is not None  # the decode-only cost is passed once two step sizes are measured


def test_a_larger_bank_lets_one_step_spend_more_of_what_its_decodes_saved():
    wide = StepBudget(0.1, bank=8.0)
    t = wide.target_s
    assert wide.step_target([(0.0, 10)], t) == pytest.approx(8 * t)  # 10 tokens banked, 8 may go at once
    assert wide.step_target([(0.0, 3)], 2 * t) == pytest.approx(2 * t)  # no more than it banked
    assert StepBudget(0.1, bank=2.0).step_target([(0.0, 10)], t) == pytest.approx(2 * t)  # 2 targets at most
    assert StepBudget(0.1).step_target([(0.0, 10)], t) == pytest.approx(10 * t)  # the default: all it banked
    with pytest.raises(ValueError, match="bank must be >= 1"):
        StepBudget(0.1, bank=0.5)


def test_a_vision_block_waits_until_the_decodes_have_banked_room_for_it():
    s = _budget()  # the decodes' own step: 0.02 + 0.001 * 4 s
    s.record_vision(1000, 1, 0.1)  # one block over 1000 patches: 0.1 s, more than the whole target
    short = s.plan(4, 30, 1000, target_s=0.03)
    assert 0 < short.prefill_tokens <= 6 and short.vision_blocks == 0  # ~6 ms of prefill, no block
    late = s.plan(4, 30, 1000, target_s=-0.01)
    assert late.prefill_tokens == 0 and late.vision_blocks == 0  # overdue: the decodes alone
    full = s.plan(4, 30, 1000, target_s=s.max_step_s)  # the bank is full: progress, a block at least
    assert full.prefill_tokens >= 30 and full.vision_blocks == 1
    first = s.plan(4, 30, 1000, target_s=0.13, vision_first=True)  # the encode's request is older
    assert first.vision_blocks == 1 and 0 < first.prefill_tokens <= 6  # the block first, prefill in what is left


@pytest.mark.parametrize("arch", ["qwen2_vl", "qwen2_5_vl", "qwen3_vl"])
def test_sliced_steps_keep_greedy_tokens(request, arch):
    """A 1 ms SLO: every step beside a decode takes 16 prompt tokens and one vision block."""
    model_dir = request.getfixturevalue(f"{arch}_tiny")
    ref = ReferenceGenerator(model_dir)
    sp = SamplingParams(max_tokens=6, ignore_eos=True)
    eng = LLMEngine(EngineConfig(model=str(model_dir), device="cpu", slo_tpot_ms=1.0, step_budget_bank=3.0))
    assert eng.budget.max_step_s == pytest.approx(3 * eng.budget.target_s)  # the engine's bank is the setting's
    text = "a long text prompt " * 12
    eng.add_request(eng.build_request("text", text, None, SamplingParams(max_tokens=40, ignore_eos=True)))
    for _ in range(4):  # it decodes, and the budget has measured steps of two sizes
        eng.step()
    img = jpeg_bytes(procedural_image(112, 84, 3))
    eng.add_request(eng.build_request("img", f"see {PH} and {text}", [img], sp))
    blocks = len(eng.model.adapter.vision_tower.blocks)
    sliced_steps = 0
    done = {}
    while eng.has_unfinished():
        sliced_steps += eng.encoder._run is not None
        for o in eng.step():
            if o.finished:
                done[o.request_id] = o
    assert sliced_steps >= blocks - 1  # the tower ran a block per step
    assert done["img"].token_ids == ref.generate(f"see {PH} and {text}", [img], 6)
    assert done["text"].token_ids == ref.generate(text, [], 40)


def test_abort_drops_an_encode_in_flight(qwen2_vl_tiny):
    eng = LLMEngine(EngineConfig(model=str(qwen2_vl_tiny), device="cpu", slo_tpot_ms=1.0))
    eng.add_request(eng.build_request("text", "hello " * 40, None, SamplingParams(max_tokens=30, ignore_eos=True)))
    for _ in range(4):
        eng.step()
    eng.add_request(eng.build_request("img", f"see {PH}", [jpeg_bytes(procedural_image(112, 84, 4))],
                                      SamplingParams(max_tokens=4)))
    eng.step()
    assert eng.encoder._run is not None and not eng.encoder._run.run.done
    eng.abort("img")
    eng.step()
    assert eng.encoder._run is None and not eng.encoder.jobs
    done = _drain(eng)
    assert done["text"].finish_reason == "length"
