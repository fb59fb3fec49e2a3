"""Encode batching under a vision-token budget (engine/encode_plan.py): a video encoded a temporal
patch per step equals one call; greedy outputs under a tiny budget still equal transformers' golden
tokens; a small request is not held behind a many-image one or a long video (by order of outputs)."""
import json
from pathlib import Path

import pytest
import torch

from epdserve import LLM, SamplingParams
from epdserve.engine.config import EngineConfig
from epdserve.engine.encode_plan import EncodeJob, pack
from epdserve.engine.llm_engine import LLMEngine
from epdserve.engine.request_parts import MediaItem
from epdserve.engine.sequence import Sequence
from epdserve.model.demo_images import jpeg_bytes, procedural_image
from epdserve.model.reference import ReferenceGenerator
from epdserve.seams.feature_provider import LocalFeatureProvider
from tests.harness import PH

FIXTURES = Path(__file__).parents[1] / "model" / "fixtures" / "video"
VID = "<|vision_start|><|video_pad|><|vision_end|>"
SP = SamplingParams(max_tokens=4, ignore_eos=True)


def _fixture(arch):
    recs = [r for r in (json.loads(p.read_text()) for p in sorted(FIXTURES.glob("*.json"))) if r["arch"] == arch]
    rec = max(recs, key=lambda r: len(r["image_sizes"]))  # one with an image and a video where there is one
    images = [procedural_image(w, h, s) for (w, h), s in zip(rec["image_sizes"], rec["image_seeds"])]
    return rec, images, (FIXTURES / rec["video_file"]).read_bytes()


def _drain(eng, order=None):
    done = {}
    while eng.has_unfinished():
        for o in eng.step():
            if o.finished:
                done[o.request_id] = o
                if order is not None:
                    order.append(o.request_id)
    return done


# ------------------------------------------------------------------ packing, no model

def _job(key, t, tokens_per_patch, sliceable=True):
    item = MediaItem(key, None, t * tokens_per_patch, torch.tensor([t, 2, 2]))
    return EncodeJob(item, tokens_per_patch, sliceable)


def _seq(rid):
    return Sequence(rid, [], SamplingParams())


def test_pack_one_item_per_request_feeds_pipelined_prefill():
    """An E for pipelined prefill: one item of a request per call (each stored as soon as it is
    done), other requests' items still batched beside it."""
    a, b = _seq("a"), _seq("b")
    imgs = [_job(f"img{i}", 1, 10) for i in range(3)]
    slices, served = pack([(a, imgs), (b, [_job("small", 1, 4), _job("small2", 1, 4)])], budget=100, per_request=1)
    assert [s.job.item.key for s in slices] == ["img0", "small"] and served == [a, b]
    assert [s.job.item.key for s in pack([(a, imgs)], budget=100, per_request=1)[0]] == ["img1"]


def test_pack_round_robin_cuts_videos_and_never_images():
    a, b = _seq("a"), _seq("b")
    imgs = [_job(f"img{i}", 1, 10) for i in range(3)]
    small = _job("small", 1, 4)
    slices, served = pack([(a, imgs), (b, [small])], budget=25)
    assert [(s.job.item.key, s.tokens) for s in slices] == [("img0", 10), ("small", 4), ("img1", 10)]
    assert served == [a, b]
    big = _job("big", 1, 50)  # one image over the budget: alone, whole
    assert [(s.job.item.key, s.tokens) for s in pack([(a, [big]), (b, [_job("x", 1, 1)])], 25)[0]] == [("big", 50)]
    video = _job("v", 8, 6)  # 8 temporal patches of 6 tokens: 4 fit in 25
    first, _ = pack([(a, [video])], 25)
    assert [(s.start, s.end) for s in first] == [(0, 4)]
    second, _ = pack([(b, [_job("small", 1, 4)]), (a, [video])], 25)
    assert [(s.job.item.key, s.start, s.end) for s in second] == [("small", 0, 1), ("v", 4, 7)]
    whole = _job("w", 8, 6, sliceable=False)  # an architecture where cutting would change the result
    assert [(s.start, s.end) for s in pack([(a, [whole])], 25)[0]] == [(0, 8)]


# ------------------------------------------------------------------ exactness

@pytest.mark.parametrize("arch", ["qwen2_vl", "qwen2_5_vl", "qwen3_vl"])
def test_video_in_temporal_slices_equals_one_call(request, arch):
    model_dir = request.getfixturevalue(f"{arch}_tiny")
    rec, images, video = _fixture(arch)
    store = LocalFeatureProvider()
    eng = LLMEngine(EngineConfig(model=str(model_dir), device="cpu", roles="E", encode_token_budget=1), features=store)
    req = eng.build_request("r", rec["prompt"], images, videos=[video], video_options={"fps": rec["fps"]})
    eng.add_request(req)
    steps = 0
    while eng.has_unfinished():
        eng.step()
        steps += 1
    patches = sum(int(m.grid_thw[0]) for m in req.media)
    assert eng.encoder.encoder_calls == patches >= 2  # one temporal patch (or image) per step
    assert eng.load_report()["encoder_runs"] == len(req.media)
    adapter = eng.model.adapter
    for m in req.media:
        whole = adapter.encode_images([m.input.pixel_values], [m.grid_thw])[0]
        sliced = store.load(m.key, 0.0)
        assert len(sliced) == len(whole) == 1 + adapter.num_deepstack
        for x, y in zip(sliced, whole):
            assert x.shape == y.shape
            torch.testing.assert_close(x, y, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("arch, budget", [(a, 1) for a in ("qwen3_vl", "qwen3_vl_moe", "qwen2_vl", "qwen2_5_vl")]
                         + [("qwen3_vl", 12), ("qwen2_5_vl", 12)])
def test_golden_tokens_hold_under_a_small_budget(request, arch, budget):
    """budget 1: every temporal patch and image in a call of its own; 12: slices of the video and
    the image share calls."""
    model_dir = request.getfixturevalue(f"{arch}_tiny")
    rec, images, video = _fixture(arch)
    llm = LLM(model=model_dir, device="cpu", encode_token_budget=budget)
    prompt = {"prompt": rec["prompt"], "mm_processor_kwargs": {"fps": rec["fps"]},
              "multi_modal_data": {"image": images, "video": [video]}}
    out = llm.generate([prompt], SamplingParams(max_tokens=10, ignore_eos=True))[0]
    assert out.error is None and out.outputs[0].token_ids == rec["greedy_tokens"]
    calls = llm.engine.encoder.encoder_calls
    patches = sum(g[0] for g in rec["video_grid_thw"]) + len(images)
    assert calls == patches if budget == 1 else 1 < calls < patches


# ------------------------------------------------------------------ fairness (order, not timers)

def test_small_request_is_not_held_behind_ten_images(qwen2_vl_tiny):
    imgs = [jpeg_bytes(procedural_image(56, 56, 100 + i)) for i in range(10)]  # 4 vision tokens each
    small = jpeg_bytes(procedural_image(56, 56, 7))
    eng = LLMEngine(EngineConfig(model=str(qwen2_vl_tiny), device="cpu", roles="E", encode_token_budget=8),
                    features=LocalFeatureProvider())
    eng.add_request(eng.build_request("many", " ".join([PH] * 10), imgs))
    eng.step()  # "many" is under way when "small" arrives
    eng.add_request(eng.build_request("small", f"one {PH}", [small]))
    order = []
    done = _drain(eng, order)
    assert order == ["small", "many"] and all(o.error is None for o in done.values())
    assert eng.encoder.encoder_calls == 6  # 2 images a step: 2, then 1 + small, then 2, 2, 2, 1


def test_small_request_finishes_first_behind_a_long_video(qwen2_vl_tiny):
    rec = next(r for r in (json.loads(p.read_text()) for p in sorted(FIXTURES.glob("qwen2_vl_*.json")))
               if not r["image_sizes"])
    video = (FIXTURES / rec["video_file"]).read_bytes()
    small = jpeg_bytes(procedural_image(56, 56, 8))
    ref = ReferenceGenerator(qwen2_vl_tiny)
    eng = LLMEngine(EngineConfig(model=str(qwen2_vl_tiny), device="cpu", encode_token_budget=6))
    eng.add_request(eng.build_request("video", rec["prompt"], [], SP, videos=[video],
                                      video_options={"fps": rec["fps"]}))
    eng.add_request(eng.build_request("small", f"look {PH}", [small], SP))
    order = []
    done = _drain(eng, order)
    assert order == ["small", "video"]
    assert eng.encoder.encoder_calls == rec["video_grid_thw"][0][0] + 1  # a temporal patch a step, and the image
    assert done["small"].token_ids == ref.generate(f"look {PH}", [small], 4)
    assert done["video"].token_ids == rec["greedy_tokens"][:4]
