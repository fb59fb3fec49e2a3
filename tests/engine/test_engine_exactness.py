"""Greedy outputs of the engine equal transformers' generate token for token (both archs)."""
import pytest

from tests.engine.blocks import all_blocks_free
from epdserve import LLM, SamplingParams
from epdserve.model.demo_images import jpeg_bytes, procedural_image
from epdserve.model.reference import ReferenceGenerator
from tests.harness import PH


@pytest.fixture(scope="module", params=[(arch, ops) for arch in ("qwen2_vl", "qwen2_5_vl")
                                        for ops in ("native", "portable")], ids=lambda p: "-".join(p))
def setup(request):
    arch, ops = request.param
    model_dir = request.getfixturevalue(f"{arch}_tiny")
    llm = LLM(model=model_dir, device="cpu", ops=ops)
    assert llm.engine.runner.ops.name == ops
    return llm, ReferenceGenerator(model_dir)


def _check(llm, ref, prompts, max_tokens=10):
    outs = llm.generate(prompts, SamplingParams(max_tokens=max_tokens, ignore_eos=True))
    for p, o in zip(prompts, outs):
        text, images = (p["prompt"], p["multi_modal_data"]["image"]) if isinstance(p, dict) else (p, [])
        assert o.error is None
        assert o.outputs[0].token_ids == ref.generate(text, images, max_tokens), p
    assert all_blocks_free(llm.engine)


def _img(w, h, seed):
    return jpeg_bytes(procedural_image(w, h, seed))


def test_text_only(setup):
    _check(*setup, ["the quick brown fox jumps over the lazy dog"])


def test_one_image(setup):
    _check(*setup, [{"prompt": f"what is in {PH} here", "multi_modal_data": {"image": [_img(112, 84, 1)]}}])


def test_three_images_of_different_sizes(setup):
    imgs = [_img(112, 84, 2), _img(56, 140, 3), _img(168, 112, 4)]
    _check(*setup, [{"prompt": f"a {PH} b {PH} c {PH} compare them", "multi_modal_data": {"image": imgs}}])


def test_requests_join_while_others_decode(setup):
    """8 requests of different lengths arrive over several steps; later ones join running decodes."""
    llm, ref = setup
    eng = llm.engine
    prompts = []
    for i in range(8):
        text = " ".join(["word"] * (3 + 7 * i)) + f" number {i}"
        if i % 3 == 1:
            prompts.append((f"look {PH} {text}", [_img(56 + 28 * (i % 3), 84, 10 + i)]))
        else:
            prompts.append((text, []))
    params = [SamplingParams(max_tokens=6 + 2 * i, ignore_eos=True) for i in range(8)]
    results, joined_while_decoding = {}, 0
    pending = list(range(8))
    while pending or eng.has_unfinished():
        if pending:  # one new request every step
            i = pending.pop(0)
            if any(not s.in_prefill for s in eng.scheduler.running):
                joined_while_decoding += 1
            eng.add_request(eng.build_request(f"r{i}", prompts[i][0], prompts[i][1], params[i]))
        for out in eng.step():
            if out.finished:
                results[out.request_id] = out
    assert joined_while_decoding >= 3
    for i in range(8):
        assert results[f"r{i}"].error is None
        assert results[f"r{i}"].token_ids == ref.generate(prompts[i][0], prompts[i][1], params[i].max_tokens)
    assert all_blocks_free(eng)


def test_tiny_chunks_use_the_native_chunk_kernel_exactly(qwen2_vl_tiny):
    """Two-token chunks: every later chunk runs the native paged prefill kernel (not the SDPA path)."""
    llm = LLM(model=qwen2_vl_tiny, device="cpu", ops="native", max_num_batched_tokens=2)
    assert llm.engine.runner.ops.prefill_native_max >= 2
    prompt = {"prompt": f"look {PH} closely now", "multi_modal_data": {"image": [_img(56, 56, 9)]}}
    _check(llm, ReferenceGenerator(qwen2_vl_tiny), [prompt, "and a text one"], max_tokens=6)
