"""E→P through a FeatureProvider: encode-only and prefill-side engines, cache hits, recompute."""
import pytest

from epdserve import SamplingParams
from epdserve.engine.config import EngineConfig
from epdserve.engine.engine_request import EngineRequest
from epdserve.seams.feature_provider import LocalFeatureProvider
from epdserve.engine.llm_engine import LLMEngine
from epdserve.model.demo_images import jpeg_bytes, procedural_image
from epdserve.model.reference import ReferenceGenerator
from tests.harness import PH

SP = SamplingParams(max_tokens=6, ignore_eos=True)


def _drain(eng):
    done = {}
    while eng.has_unfinished():
        for o in eng.step():
            if o.finished:
                done[o.request_id] = o
    return done


@pytest.fixture(scope="module")
def ref(qwen2_vl_tiny):
    return ReferenceGenerator(qwen2_vl_tiny)


def _engine(model, roles, provider, **kw):
    return LLMEngine(EngineConfig(model=str(model), device="cpu", roles=roles, **kw), features=provider)


def test_encode_only_then_prefill_side_uses_stored_features(qwen2_vl_tiny, ref):
    store = LocalFeatureProvider()
    e = _engine(qwen2_vl_tiny, "E", store)
    pd = _engine(qwen2_vl_tiny, "PD", store, feature_wait_s=60.0)
    img = jpeg_bytes(procedural_image(112, 84, 21))
    prompt = f"tell me about {PH} now"
    pd.add_request(pd.build_request("r", prompt, [img], SP))
    pd.step()  # waits (bounded) for the feature instead of recomputing
    r = pd.load_report()
    assert r["queued_media"] == 1 and r["encoder_runs"] == 0
    media = e.build_request("r", prompt, [img]).media
    e.add_request(EngineRequest("r", [], media, feature_target="pd-0"))
    encoded = _drain(e)["r"]
    assert encoded.error is None and encoded.finish_reason is None  # handed to the prefill side
    assert encoded.encoded_keys == [m.key for m in media]
    out = _drain(pd)["r"]
    r = pd.load_report()
    assert r["encoder_runs"] == 0 and r["recomputes"] == 0
    assert out.num_cached_vision_tokens == out.num_vision_tokens > 0
    assert out.token_ids == ref.generate(prompt, [img], 6)


def test_missing_feature_is_recomputed_with_same_output(qwen2_vl_tiny, ref):
    pd = _engine(qwen2_vl_tiny, "PD", LocalFeatureProvider(), feature_wait_s=0.0)
    img = jpeg_bytes(procedural_image(84, 84, 22))
    prompt = f"what about {PH}?"
    pd.add_request(pd.build_request("r", prompt, [img], SP))
    out = _drain(pd)["r"]
    assert pd.load_report()["recomputes"] == 1 and out.num_cached_vision_tokens == 0
    assert out.token_ids == ref.generate(prompt, [img], 6)


def test_missing_feature_without_bytes_fails_only_that_request(qwen2_vl_tiny):
    pd = _engine(qwen2_vl_tiny, "PD", LocalFeatureProvider(), feature_wait_s=0.0)  # no E: fail at once
    bad = pd.build_request("bad", f"x {PH}", [jpeg_bytes(procedural_image(56, 56, 1))], SP)
    bad.media[0].input = None  # the client referenced a stored key only
    pd.add_request(bad)
    pd.add_request(pd.build_request("good", "plain text", [], SP))
    done = _drain(pd)
    assert "not in the store" in done["bad"].error
    assert done["good"].error is None and len(done["good"].token_ids) == 6


def test_repeated_image_is_encoded_once(qwen2_vl_tiny, ref):
    eng = _engine(qwen2_vl_tiny, "EPD", LocalFeatureProvider())
    img = jpeg_bytes(procedural_image(112, 112, 23))
    eng.add_request(eng.build_request("a", f"first {PH}", [img], SP))
    first = _drain(eng)["a"]
    eng.add_request(eng.build_request("b", f"second {PH} look", [img], SP))
    second = _drain(eng)["b"]
    assert eng.load_report()["encoder_runs"] == 1
    assert first.num_cached_vision_tokens == 0 and second.num_cached_vision_tokens == second.num_vision_tokens
    assert second.token_ids == ref.generate(f"second {PH} look", [img], 6)
