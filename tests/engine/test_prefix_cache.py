"""The prefix cache (engine/block_manager.py, prefix_hash.py): a conversation's next turn reuses
the KV of what it already sent — its image neither encoded nor fetched again — with the same
greedy tokens as transformers' generate; keys carry the media, so another image shares nothing
past its first block; eviction, abort and preemption keep outputs exact and leave no reference."""
import pytest

from epdserve.engine.config import EngineConfig
from epdserve.engine.llm_engine import LLMEngine
from epdserve.engine.sampling_params import SamplingParams
from epdserve.model.demo_images import jpeg_bytes, procedural_image
from epdserve.model.reference import ReferenceGenerator
from tests.harness import PH

SP = SamplingParams(max_tokens=6, ignore_eos=True)
BLOCK_BYTES = 2 * 2 * 16 * 2 * 16 * 4  # K and V, 2 layers, 16 tokens, 2 KV heads of 16, fp32: the tiny demo


def _run(eng, rid, prompt, images, sp=SP):
    eng.add_request(eng.build_request(rid, prompt, images, sp))
    out = None
    while eng.has_unfinished():
        for o in eng.step():
            if o.request_id == rid and o.finished:
                out = o
    return out


def _idle(eng):
    bm = eng.scheduler._blocks
    assert not any(bm._refs) and bm.num_free == bm.num_blocks and not bm._tables


@pytest.mark.parametrize("arch", ["qwen2_vl", "qwen2_5_vl", "qwen3_vl", "qwen3_vl_moe"])
def test_second_turn_reuses_the_first_and_skips_its_image(request, arch):
    model_dir = request.getfixturevalue(f"{arch}_tiny")
    ref = ReferenceGenerator(model_dir)
    img = jpeg_bytes(procedural_image(112, 84, 5))
    turn1 = f"user: look {PH} what is it? " * 1 + "and more words to fill a few blocks " * 3
    on = LLMEngine(EngineConfig(model=str(model_dir), device="cpu"))
    off = LLMEngine(EngineConfig(model=str(model_dir), device="cpu", enable_prefix_caching=False))
    first = _run(on, "t1", turn1, [img])
    answer = on.tokenizer.decode(first.token_ids)
    turn2 = turn1 + answer + " user: and now? "
    runs = on.encoder.encoder_runs
    second = _run(on, "t2", turn2, [img])
    assert on.encoder.encoder_runs == runs  # the image lies in the reused prefix: not encoded again
    assert second.num_cached_tokens >= 16 * ((len(on.build_request("x", turn1, [img]).prompt_token_ids)) // 16) - 16
    assert second.num_cached_vision_tokens == second.num_vision_tokens
    assert list(second.token_ids) == ref.generate(turn2, [img], 6) == list(_run(off, "t2", turn2, [img]).token_ids)
    assert list(first.token_ids) == ref.generate(turn1, [img], 6)
    _idle(on)
    assert on.scheduler._blocks.num_cached > 0


def test_same_text_other_image_shares_nothing_past_the_image(qwen2_vl_tiny):
    eng = LLMEngine(EngineConfig(model=str(qwen2_vl_tiny), device="cpu"))
    prompt = "some words before the image " * 3 + PH + " and the same words after it" * 4
    a, b = (jpeg_bytes(procedural_image(112, 84, s)) for s in (1, 2))
    _run(eng, "a", prompt, [a])
    req = eng.build_request("x", prompt, [b])
    first_image_token = req.prompt_token_ids.index(eng.model.adapter.image_token_id)
    out = _run(eng, "b", prompt, [b])
    assert 0 < out.num_cached_tokens <= first_image_token  # the text before it, whole blocks only
    assert out.num_cached_tokens % 16 == 0
    same = _run(eng, "c", prompt, [a])
    assert same.num_cached_tokens > first_image_token


def test_eviction_under_memory_pressure_stays_exact(qwen2_vl_tiny):
    ref = ReferenceGenerator(qwen2_vl_tiny)
    eng = LLMEngine(EngineConfig(model=str(qwen2_vl_tiny), device="cpu", kv_cache_bytes=12 * BLOCK_BYTES))
    bm = eng.scheduler._blocks
    prompts = [f"prompt number {i} " + "filler words " * 20 for i in range(6)]
    outs = [_run(eng, f"r{i}", p, None) for i, p in enumerate(prompts)]
    assert bm.evictions > 0  # the cache filled up and gave blocks back
    again = _run(eng, "again", prompts[-1], None)
    for p, o in zip(prompts, outs):
        assert list(o.token_ids) == ref.generate(p, None, 6)
    assert list(again.token_ids) == list(outs[-1].token_ids) and again.num_cached_tokens > 0
    _idle(eng)


def test_abort_and_preemption_leave_no_reference(qwen2_vl_tiny):
    ref = ReferenceGenerator(qwen2_vl_tiny)
    eng = LLMEngine(EngineConfig(model=str(qwen2_vl_tiny), device="cpu", kv_cache_bytes=12 * BLOCK_BYTES))
    img = jpeg_bytes(procedural_image(112, 84, 9))
    prompt = f"look {PH} " + "long question words " * 10
    _run(eng, "warm", prompt, [img])
    long = SamplingParams(max_tokens=60, ignore_eos=True)
    eng.add_request(eng.build_request("p1", prompt, [img], long))
    eng.add_request(eng.build_request("p2", prompt + " other", [img], long))
    eng.add_request(eng.build_request("gone", prompt, [img], long))
    eng.step()
    eng.abort("gone")
    done = {}
    while eng.has_unfinished():
        for o in eng.step():
            if o.finished:
                done[o.request_id] = o
    assert list(done["p1"].token_ids) == ref.generate(prompt, [img], 60)
    assert list(done["p2"].token_ids) == ref.generate(prompt + " other", [img], 60)
    assert done["gone"].finish_reason == "abort"
    assert eng.scheduler.num_preemptions > 0  # the KV cache was too small for both: one waited
    _idle(eng)
