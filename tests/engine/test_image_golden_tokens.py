"""Image prompts through the engine (every family; one and several images, sizes that are scaled up,
rounded and scaled down): greedy outputs equal the golden tokens transformers' own processor and
`generate` made (tests/model/fixtures/image), with no epdserve preprocessing on the oracle's side.
Modes: the whole pipeline in one engine (`LLM`), and split: an encode-only engine handing its
features to a prefill+decode engine (E → PD, the features crossing a `FeatureProvider`)."""
import pytest

from epdserve import LLM, SamplingParams
from epdserve.engine.config import EngineConfig
from epdserve.engine.engine_request import EngineRequest
from epdserve.engine.llm_engine import LLMEngine
from epdserve.seams.feature_provider import LocalFeatureProvider
from tests.engine.blocks import all_blocks_free
from tests.model.image_goldens import ARCHS, checked_cases


def _drain(eng) -> dict:
    done = {}
    while eng.has_unfinished():
        done.update((o.request_id, o) for o in eng.step() if o.finished)
    return done


@pytest.mark.parametrize("arch", ARCHS)
def test_whole_pipeline_matches_transformers_golden_tokens(request, arch):
    model_dir = request.getfixturevalue(f"{arch}_tiny")
    cases = checked_cases(model_dir, arch)
    llm = LLM(model=model_dir, device="cpu")
    outs = llm.generate([{"prompt": p, "multi_modal_data": {"image": imgs}} for p, imgs, _ in cases],
                        SamplingParams(max_tokens=10, ignore_eos=True))
    for (_, _, rec), out in zip(cases, outs):
        assert out.error is None and out.num_prompt_tokens == len(rec["input_ids"])
        assert out.outputs[0].token_ids == rec["greedy_tokens"], rec["image_sizes"]
    assert all_blocks_free(llm.engine)


@pytest.mark.parametrize("arch", ARCHS)
def test_encode_then_prefill_decode_matches_transformers_golden_tokens(request, arch):
    model_dir = request.getfixturevalue(f"{arch}_tiny")
    cases = checked_cases(model_dir, arch)
    store = LocalFeatureProvider()
    e = LLMEngine(EngineConfig(model=str(model_dir), device="cpu", roles="E"), features=store)
    pd = LLMEngine(EngineConfig(model=str(model_dir), device="cpu", roles="PD", feature_wait_s=60.0),
                   model=e.model, features=store)
    sp = SamplingParams(max_tokens=10, ignore_eos=True)
    for n, (prompt, images, _) in enumerate(cases):
        req = pd.build_request(f"r{n}", prompt, images, sp)
        pd.add_request(req)
        e.add_request(EngineRequest(f"r{n}", [], req.media, feature_target="pd-0"))
    encoded = _drain(e)
    assert sorted(encoded) == [f"r{n}" for n in range(len(cases))] and all(o.error is None for o in encoded.values())
    done = _drain(pd)
    assert pd.load_report()["encoder_runs"] == 0 and pd.load_report()["recomputes"] == 0  # E's features were used
    for n, (_, _, rec) in enumerate(cases):
        assert done[f"r{n}"].error is None and done[f"r{n}"].token_ids == rec["greedy_tokens"], rec["image_sizes"]
    assert all_blocks_free(pd)


def test_a_changed_resize_rule_changes_the_golden_compare(qwen2_vl_tiny, monkeypatch):
    """Negative control: with one rule of the image resize changed in epdserve's path (the sides
    rounded up to the patch factor instead of to the nearest multiple), the engine no longer
    produces the golden tokens of the 97x61 image: the token compare notices preprocessing drift."""
    import math

    from transformers.models.qwen2_vl import image_processing_pil_qwen2_vl as pil

    rule = pil.smart_resize
    monkeypatch.setattr(pil, "smart_resize", lambda height, width, factor, min_pixels, max_pixels: rule(
        math.ceil(height / factor) * factor, math.ceil(width / factor) * factor, factor=factor, min_pixels=min_pixels,
        max_pixels=max_pixels))
    prompt, images, rec = next(c for c in checked_cases(qwen2_vl_tiny, "qwen2_vl") if c[2]["image_sizes"] == [[97, 61]])
    out = LLM(model=qwen2_vl_tiny, device="cpu").generate([{"prompt": prompt, "multi_modal_data": {"image": images}}],
                                                          SamplingParams(max_tokens=10, ignore_eos=True))[0]
    assert out.error is None and out.num_prompt_tokens != len(rec["input_ids"])
    assert out.outputs[0].token_ids != rec["greedy_tokens"]
