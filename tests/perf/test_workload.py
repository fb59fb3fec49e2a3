"""Workload generator: seeded, shaped by its knobs, arrivals with the asked rate and burstiness."""
import io

import numpy as np
import pytest
from PIL import Image

from epdserve.perf.arrivals import arrival_times
from epdserve.perf.presets import PRESETS
from epdserve.perf.workload import PLACEHOLDER, WorkloadConfig, build_workload, parse_mix, resolution_size

SMALL = WorkloadConfig(name="t", num_requests=12, resolution_scale=0.1, output_len_mean=20, output_len_std=5,
                       output_len_min=10, output_len_max=25, text_prompt_words_mean=10, text_prompt_words_std=2)


def test_same_config_same_requests_other_seed_differs():
    a, b = build_workload(SMALL), build_workload(SMALL)
    assert [(r.prompt, r.images, r.max_tokens) for r in a] == [(r.prompt, r.images, r.max_tokens) for r in b]
    c = build_workload(SMALL.with_(seed=1))
    assert [r.images for r in a] != [r.images for r in c]


def test_placeholders_match_images_and_jpegs_decode_at_the_scaled_size():
    cfg = SMALL.with_(images_min=1, images_max=3, resolution_mix={"720p": 1.0})
    reqs = build_workload(cfg)
    assert {len(r.images) for r in reqs} <= {1, 2, 3} and len({len(r.images) for r in reqs}) > 1
    for r in reqs:
        assert r.prompt.count(PLACEHOLDER) == len(r.images) == len(r.image_labels)
        assert r.prompt.startswith("<|im_start|>system") and r.prompt.endswith("<|im_start|>assistant\n")
        img = Image.open(io.BytesIO(r.images[0]))
        assert img.format == "JPEG" and img.size == (128, 72)


def test_output_lengths_are_clipped_normal():
    reqs = build_workload(SMALL.with_(num_requests=200, text_only_share=1.0))
    lens = np.array([r.max_tokens for r in reqs])
    assert lens.min() >= 10 and lens.max() <= 25
    assert 18 < lens.mean() < 22 and lens.std() > 2


def test_text_only_share_and_repeated_images():
    reqs = build_workload(SMALL.with_(num_requests=200, text_only_share=0.5, resolution_scale=0.05))
    text = [r for r in reqs if r.kind == "text"]
    assert 70 < len(text) < 130
    assert all(PLACEHOLDER not in r.prompt and not r.images for r in text)
    none = build_workload(SMALL.with_(num_requests=40, resolution_scale=0.05))
    assert sum(r.repeated_images for r in none) == 0
    rep = build_workload(SMALL.with_(num_requests=40, resolution_scale=0.05, repeated_image_share=0.5))
    seen, repeats = set(), 0
    for r in rep:
        repeats += sum(1 for im in r.images if im in seen)
        seen.update(r.images)
    assert repeats == sum(r.repeated_images for r in rep) and 10 < repeats < 30


def test_resolution_mix_weights():
    reqs = build_workload(SMALL.with_(num_requests=200, resolution_scale=0.05,
                                      resolution_mix=parse_mix("360p:3,720p:1")))
    labels = [lab for r in reqs for lab in r.image_labels]
    assert set(labels) == {"360p", "720p"} and 0.65 < labels.count("360p") / len(labels) < 0.85


def test_resolution_names_and_bad_knobs():
    assert resolution_size("360p") == (640, 360) and resolution_size("100x50", 0.5) == (56, 56)
    assert parse_mix("360p") == {"360p": 1.0}
    for bad in (dict(num_requests=0), dict(text_only_share=1.5), dict(images_min=3, images_max=2),
                dict(resolution_mix=(("potato", 1.0),)), dict(resolution_scale=0)):
        with pytest.raises(ValueError):
            WorkloadConfig(**bad)


def test_poisson_and_bursty_arrivals():
    assert arrival_times(3, float("inf")) == [0.0, 0.0, 0.0]
    t = np.array(arrival_times(4000, rate=10.0, burstiness=1.0, seed=1))
    gaps = np.diff(t)
    assert t[0] == 0 and np.all(gaps >= 0)
    assert gaps.mean() == pytest.approx(0.1, rel=0.1)
    assert gaps.std() / gaps.mean() == pytest.approx(1.0, rel=0.1)  # exponential: CV 1
    bursty = np.diff(arrival_times(4000, rate=10.0, burstiness=0.25, seed=1))
    assert bursty.mean() == pytest.approx(0.1, rel=0.15) and bursty.std() / bursty.mean() == pytest.approx(2.0, rel=0.15)
    assert arrival_times(10, 2.0, seed=3) == arrival_times(10, 2.0, seed=3)
    with pytest.raises(ValueError):
        arrival_times(3, 0.0)


def test_presets_are_valid_and_shaped_as_named():
    assert PRESETS["mixed"].text_only_share == 0.5
    assert PRESETS["image-heavy"].images_min >= 2
    assert PRESETS["text-heavy"].output_len_mean > PRESETS["image-heavy"].output_len_mean
