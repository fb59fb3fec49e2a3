"""Qwen3-VL and Qwen3-VL-MoE in the offline API: greedy outputs equal transformers' generate,
DeepStack included, also when chunked prefill cuts an image in two."""
import pytest

from tests.engine.blocks import all_blocks_free
from epdserve import LLM, SamplingParams
from epdserve.model.demo_images import jpeg_bytes, procedural_image
from epdserve.model.reference import ReferenceGenerator
from tests.harness import PH

ARCHS = ("qwen3_vl", "qwen3_vl_moe")


def _img(w, h, seed):
    return jpeg_bytes(procedural_image(w, h, seed))


PROMPTS = [
    ("the quick brown fox jumps over the lazy dog", []),
    (f"what is in {PH} here", [_img(112, 84, 1)]),
    (f"a {PH} b {PH} c {PH} compare them", [_img(100, 76, 2), _img(56, 140, 3), _img(171, 113, 4)]),
]


@pytest.fixture(scope="module", params=ARCHS)
def model_dir(request):
    return request.getfixturevalue(f"{request.param}_tiny")


@pytest.fixture(scope="module")
def ref(model_dir):
    return ReferenceGenerator(model_dir)


def _run(llm, prompts, max_tokens=10):
    inputs = [{"prompt": p, "multi_modal_data": {"image": imgs}} if imgs else p for p, imgs in prompts]
    outs = llm.generate(inputs, SamplingParams(max_tokens=max_tokens, ignore_eos=True))
    assert all(o.error is None for o in outs)
    return [o.outputs[0].token_ids for o in outs]


def test_batched_requests_with_0_1_and_3_images(model_dir, ref):
    llm = LLM(model=model_dir, device="cpu")
    assert llm.engine.model.adapter.num_deepstack == 2
    got = _run(llm, PROMPTS)
    assert got == [ref.generate(p, imgs, 10) for p, imgs in PROMPTS]
    assert all_blocks_free(llm.engine)


def test_chunked_prefill_cuts_images(model_dir, ref):
    """7-token chunks: chunk boundaries fall inside each image of a one-request prompt."""
    chunk = 7
    llm = LLM(model=model_dir, device="cpu", max_num_batched_tokens=chunk)
    prompt, imgs = PROMPTS[2]
    ids = llm.engine.build_request("probe", prompt, imgs).prompt_token_ids
    image_id = llm.engine.model.adapter.image_token_id
    cut = [k for k in range(chunk, len(ids), chunk) if ids[k - 1] == ids[k] == image_id]
    assert len(cut) >= 3  # images straddle chunk boundaries
    assert _run(llm, [(prompt, imgs)]) == [ref.generate(prompt, imgs, 10)]
    assert all_blocks_free(llm.engine)


def test_deepstack_changes_the_output(model_dir, ref, monkeypatch):
    """Negative control: without DeepStack the engine no longer matches, so the checks above see it."""
    import epdserve.engine.model_runner as model_runner

    llm = LLM(model=model_dir, device="cpu")
    monkeypatch.setattr(model_runner, "chunk_deepstack", lambda *args: None)
    prompts = PROMPTS[1:]
    assert _run(llm, prompts) != [ref.generate(p, imgs, 10) for p, imgs in prompts]
