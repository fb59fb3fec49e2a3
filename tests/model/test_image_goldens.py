"""Image preprocessing against Hugging Face's own processor (golden fixtures made by
tests/model/fixtures/image/make_fixtures.py): the prompt ids with expanded placeholders, each
image's grid and the pixels, bit for bit, for every family, from both places epdserve preprocesses
(an engine's `LoadedModel.processor` and the scheduler's `RequestPreprocessor`). A negative control
shows the compare notices one changed resize rule."""
import math

import pytest
import torch

from epdserve.engine.loaded_model import load_model
from epdserve.scheduler.preprocess import RequestPreprocessor
from tests.model.image_goldens import ARCHS, FIXTURES, checked_cases, pixel_digest


def _processor(model_dir, side):
    if side == "engine":
        return load_model(str(model_dir), "cpu", "float32").processor
    return RequestPreprocessor(str(model_dir)).processor


def _mismatches(processor, cases) -> list[str]:
    """What differs from the goldens, one line per field per case (empty: all equal)."""
    bad = []
    for prompt, images, rec in cases:
        p = processor.process(prompt, images)
        name = f"{rec['arch']} {rec['image_sizes']}"
        if p.token_ids != rec["input_ids"]:
            bad.append(f"{name}: input ids")
        if [m.grid_thw.tolist() for m in p.media] != rec["image_grid_thw"]:
            bad.append(f"{name}: grids")
        pixels = torch.cat([m.pixel_values for m in p.media])
        if list(pixels.shape) != rec["pixel_values_shape"] or pixel_digest(pixels) != rec["pixel_values_sha256"]:
            bad.append(f"{name}: pixels")
    return bad


def test_fixtures_present():
    assert sorted(p.stem for p in FIXTURES.glob("*.json")) == sorted(
        f"{a}_{c}" for a in ARCHS for c in ("large", "odd", "several"))


@pytest.mark.parametrize("side", ["engine", "scheduler"])
@pytest.mark.parametrize("arch", ARCHS)
def test_ids_grids_and_pixels_equal_transformers(request, arch, side):
    model_dir = request.getfixturevalue(f"{arch}_tiny")
    assert _mismatches(_processor(model_dir, side), checked_cases(model_dir, arch)) == []


def test_a_changed_resize_rule_is_noticed(qwen2_vl_tiny, monkeypatch):
    """Negative control: round the resized sides up instead of to the nearest patch multiple (one
    rule of transformers' `smart_resize`, which epdserve's image path runs); the compare must fail."""
    from transformers.models.qwen2_vl import image_processing_pil_qwen2_vl as pil

    rule = pil.smart_resize

    def ceil_instead_of_round(height, width, factor, min_pixels, max_pixels):
        return rule(math.ceil(height / factor) * factor, math.ceil(width / factor) * factor, factor=factor,
                    min_pixels=min_pixels, max_pixels=max_pixels)

    processor = _processor(qwen2_vl_tiny, "engine")
    cases = checked_cases(qwen2_vl_tiny, "qwen2_vl")
    assert _mismatches(processor, cases) == []
    monkeypatch.setattr(pil, "smart_resize", ceil_instead_of_round)
    bad = _mismatches(processor, cases)
    assert any("[[97, 61]]: grids" in b for b in bad) and any("pixels" in b for b in bad), bad


def test_the_hf_oracle_reproduces_the_goldens(qwen2_vl_tiny):
    """`tests.hf_oracle`, which the serving tests compare with at run time, gives the pinned goldens'
    ids and tokens (from PNG bytes, as those tests send images): it cannot drift from them unseen."""
    from tests.hf_oracle import HFOracle

    hf = HFOracle(qwen2_vl_tiny)
    for prompt, images, rec in checked_cases(qwen2_vl_tiny, "qwen2_vl"):
        assert hf.inputs(prompt, images)["input_ids"][0].tolist() == rec["input_ids"]
        assert hf.generate(prompt, images, rec["max_new_tokens"], ignore_eos=True) == rec["greedy_tokens"]
