"""Chunked prefill, preemption under KV pressure, aborts: outputs stay exact, no block leaks."""
import pytest

from tests.engine.blocks import all_blocks_free, some_blocks_used
from epdserve import LLM, SamplingParams
from epdserve.engine.kv_cache import KVCacheSpec
from epdserve.model.demo_images import jpeg_bytes, procedural_image
from epdserve.model.reference import ReferenceGenerator
from tests.harness import PH


@pytest.fixture(scope="module")
def ref(qwen2_vl_tiny):
    return ReferenceGenerator(qwen2_vl_tiny)


def _prompts():
    img = jpeg_bytes(procedural_image(112, 112, 5))
    return [
        (" ".join(f"tok{i}" for i in range(40)), []),
        (f"see {PH} and say " + "more " * 20, [img]),
        ("short one", []),
        ("another prompt with several words in it " * 3, []),
    ]


def _run(llm, prompts, max_tokens):
    outs = llm.generate(
        [{"prompt": t, "multi_modal_data": {"image": i}} for t, i in prompts],
        SamplingParams(max_tokens=max_tokens, ignore_eos=True),
    )
    return [o.outputs[0].token_ids for o in outs]


def test_chunked_prefill_matches_reference(qwen2_vl_tiny, ref):
    llm = LLM(model=qwen2_vl_tiny, device="cpu", max_num_batched_tokens=16)
    prompts = _prompts()
    got = _run(llm, prompts, 8)
    assert got == [ref.generate(t, i, 8) for t, i in prompts]
    assert all_blocks_free(llm.engine)


def test_preemption_under_kv_pressure_loses_nothing(qwen2_vl_tiny, ref):
    probe = LLM(model=qwen2_vl_tiny, device="cpu")
    a = probe.engine.model.adapter
    spec = KVCacheSpec(a.num_layers, a.num_kv_heads, a.head_dim, 16, probe.engine.kv_cache.spec.dtype)
    # 12 blocks = 192 tokens: not enough for all four requests at once (≈ 330 tokens in total)
    llm = LLM(model=qwen2_vl_tiny, device="cpu", block_size=16, kv_cache_bytes=12 * spec.bytes_per_block())
    prompts = _prompts()
    got = _run(llm, prompts, 24)
    assert llm.engine.scheduler.num_preemptions > 0
    assert got == [ref.generate(t, i, 24) for t, i in prompts]
    assert all_blocks_free(llm.engine)


def test_abort_frees_blocks(qwen2_vl_tiny):
    llm = LLM(model=qwen2_vl_tiny, device="cpu")
    eng = llm.engine
    eng.add_request(eng.build_request("a", "some words to decode for a while", [], SamplingParams(max_tokens=50, ignore_eos=True)))
    eng.add_request(eng.build_request("b", "other words", [], SamplingParams(max_tokens=5, ignore_eos=True)))
    for _ in range(3):
        eng.step()
    assert some_blocks_used(eng)
    eng.abort("a")
    finished = {}
    while eng.has_unfinished():
        for o in eng.step():
            if o.finished:
                finished[o.request_id] = o
    assert finished["a"].finish_reason == "abort"
    assert finished["b"].finish_reason == "length" and len(finished["b"].token_ids) == 5
    assert all_blocks_free(eng)
