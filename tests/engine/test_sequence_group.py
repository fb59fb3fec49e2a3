"""n > 1 as one sequence group (engine/sequence_group.py): the prompt prefilled once, the choices
forked at the first token sharing its KV blocks, each choice exactly what a single request with
its seed would have produced; blocks all free again after the group ends or is aborted."""
import json

import pytest

from tests.engine.blocks import all_blocks_free, some_blocks_used
from tests.hf_oracle import HFOracle
from epdserve import LLM, SamplingParams
from epdserve.engine.config import EngineConfig
from epdserve.engine.llm_engine import LLMEngine
from epdserve.engine.structured_output import StructuredOutput

PROMPT = "a prompt whose last block is partly full, so the choices copy it"


@pytest.fixture(scope="module")
def llm(qwen2_vl_tiny):
    return LLM(model=qwen2_vl_tiny, device="cpu", enable_prefix_caching=False)


def _ids(out):
    return [c.token_ids for c in out.outputs]


def test_greedy_choices_equal_transformers(llm, qwen2_vl_tiny):
    want = HFOracle(qwen2_vl_tiny).generate(PROMPT, max_tokens=10, ignore_eos=True)
    out = llm.generate(PROMPT, SamplingParams(max_tokens=10, ignore_eos=True, n=3))[0]
    assert [c.index for c in out.outputs] == [0, 1, 2]
    assert _ids(out) == [want] * 3
    assert all_blocks_free(llm.engine)


def test_seeded_choices_equal_single_requests_with_seed_plus_j(llm):
    kw = dict(max_tokens=12, temperature=1.0, ignore_eos=True, frequency_penalty=0.5, logprobs=2)
    singles = [llm.generate(PROMPT, SamplingParams(seed=11 + j, **kw))[0].outputs[0] for j in range(3)]
    group = llm.generate(PROMPT, SamplingParams(seed=11, n=3, **kw))[0].outputs
    assert [c.token_ids for c in group] == [s.token_ids for s in singles]
    assert len({tuple(s.token_ids) for s in singles}) > 1, "the seeds should give different outputs"
    assert [c.logprobs[0] for c in group] == [s.logprobs[0] for s in singles]  # one row, drawn n times
    for c, s in zip(group, singles):  # later tokens: the choices decode batched, a single one alone
        assert [a.top_ids for a in c.logprobs] == [b.top_ids for b in s.logprobs]
        assert max(abs(a.logprob - b.logprob) for a, b in zip(c.logprobs, s.logprobs)) < 1e-4
    assert [c.text for c in group] == [s.text for s in singles]


@pytest.mark.parametrize("prompt", [PROMPT, list(range(100, 132))], ids=["partial-block", "whole-blocks"])
def test_prompt_prefilled_once(qwen2_vl_tiny, prompt):
    counts = {}
    for n in (1, 4):
        eng = LLMEngine(EngineConfig(model=str(qwen2_vl_tiny), device="cpu", enable_prefix_caching=False))
        assert eng.config.block_size == 16 and (isinstance(prompt, str) or len(prompt) % 16 == 0)
        eng.add_request(eng.build_request("g", prompt, params=SamplingParams(max_tokens=4, ignore_eos=True, n=n)))
        ends = [o for _ in range(50) if eng.has_unfinished() for o in eng.step() if o.finished]
        assert sorted(o.index for o in ends) == list(range(n)) and {o.request_id for o in ends} == {"g"}
        assert all(len(o.token_ids) == 4 for o in ends)
        counts[n] = (eng.stats.as_dict()["prompt_tokens"], eng.stats.as_dict()["decode_tokens"])
        assert all_blocks_free(eng)
    assert counts[4][0] == counts[1][0]
    assert counts[4][1] == 4 * counts[1][1]


def test_abort_frees_every_block(qwen2_vl_tiny):
    eng = LLMEngine(EngineConfig(model=str(qwen2_vl_tiny), device="cpu"))
    sp = SamplingParams(max_tokens=50, ignore_eos=True, n=3)
    eng.add_request(eng.build_request("before", PROMPT, params=sp))
    eng.abort("before")  # before its first token: every choice ends
    outs = eng.step()
    assert sorted((o.index, o.finish_reason) for o in outs) == [(j, "abort") for j in range(3)]
    eng.add_request(eng.build_request("after", PROMPT, params=sp))
    seen = set()
    while len(seen) < 3:
        seen |= {o.index for o in eng.step()}
    eng.step()
    assert some_blocks_used(eng) and eng.load_report()["running"] == 3
    eng.abort("after")
    assert sorted((o.index, o.finish_reason) for o in eng.step() if o.finished) == [(j, "abort") for j in range(3)]
    assert all_blocks_free(eng) and not eng.has_unfinished()


def test_preempted_choices_recompute_their_own_output(qwen2_vl_tiny):
    ref = LLM(model=qwen2_vl_tiny, device="cpu").generate(PROMPT, SamplingParams(max_tokens=40, ignore_eos=True))
    probe = LLMEngine(EngineConfig(model=str(qwen2_vl_tiny), device="cpu"))
    tight = LLM(model=qwen2_vl_tiny, device="cpu", kv_cache_bytes=6 * probe.kv_cache.spec.bytes_per_block())
    out = tight.generate(PROMPT, SamplingParams(max_tokens=40, ignore_eos=True, n=3))[0]
    assert tight.engine.scheduler.num_preemptions > 0
    assert _ids(out) == [ref[0].outputs[0].token_ids] * 3
    assert all_blocks_free(tight.engine)


def test_structured_choices_each_follow_the_grammar(llm):
    c = StructuredOutput("json_object")
    kw = dict(max_tokens=40, temperature=1.0, structured=c)
    singles = [llm.generate(PROMPT, SamplingParams(seed=3 + j, **kw))[0].outputs[0] for j in range(3)]
    group = llm.generate(PROMPT, SamplingParams(seed=3, n=3, **kw))[0].outputs
    assert [g.token_ids for g in group] == [s.token_ids for s in singles]
    # seeds 3-5 end two of the choices on the grammar's own end (`{}`, then EOS): without the
    # grammar's mask none ends on stop (every one runs to the length) or starts with `{`
    assert any(g.finish_reason == "stop" for g in group), [(g.finish_reason, g.text) for g in group]
    for g in group:
        assert g.text.startswith("{"), g.text
        if g.finish_reason == "stop":
            assert isinstance(json.loads(g.text), dict)


def test_choice_ids_are_kept_for_the_group(qwen2_vl_tiny):
    eng = LLMEngine(EngineConfig(model=str(qwen2_vl_tiny), device="cpu"))
    eng.add_request(eng.build_request("x", PROMPT, params=SamplingParams(max_tokens=3, n=2)))
    with pytest.raises(ValueError, match="kept for a choice"):
        eng.add_request(eng.build_request("x-c1", PROMPT, params=SamplingParams(max_tokens=3)))
    eng.add_request(eng.build_request("x-c2", PROMPT, params=SamplingParams(max_tokens=3)))  # not one of x's
    with pytest.raises(ValueError, match="n must be"):
        SamplingParams(n=0)


def test_a_choice_with_no_block_for_its_copy_recomputes_the_partial_block(qwen2_vl_tiny):
    ref = LLM(model=qwen2_vl_tiny, device="cpu").generate(PROMPT, SamplingParams(max_tokens=8, ignore_eos=True))
    probe = LLMEngine(EngineConfig(model=str(qwen2_vl_tiny), device="cpu"))
    n_prompt = len(probe.build_request("p", PROMPT).prompt_token_ids)
    assert n_prompt % 16 and -(-(n_prompt + 8) // 16) == 3, "the prompt and its output fill 3 blocks"
    # 4 blocks: the parent holds 3, choice 1 takes the last for its copy, choice 2 waits for one
    tight = LLM(model=qwen2_vl_tiny, device="cpu", kv_cache_bytes=4 * probe.kv_cache.spec.bytes_per_block())
    out = tight.generate(PROMPT, SamplingParams(max_tokens=8, ignore_eos=True, n=3))[0]
    assert _ids(out) == [ref[0].outputs[0].token_ids] * 3
    # choice 2 recomputed its partial block and its first token, nothing else
    assert tight.engine.stats.as_dict()["prompt_tokens"] == n_prompt + n_prompt % 16 + 1
    assert all_blocks_free(tight.engine)
