"""Video through the offline API (Qwen3-VL(-MoE), Qwen2-VL, Qwen2.5-VL): greedy outputs equal the golden tokens
transformers' generate made from its own video pipeline (tests/model/fixtures/video), chunked
prefill included; a video's features are one cached entry per (bytes, sampling options)."""
import hashlib
import json
from pathlib import Path

import pytest

from tests.engine.blocks import all_blocks_free
from epdserve import LLM, SamplingParams
from epdserve.model.demo_images import procedural_image

FIXTURES = Path(__file__).parents[1] / "model" / "fixtures" / "video"
VID = "<|vision_start|><|video_pad|><|vision_end|>"


def _cases(arch):
    out = []
    for path in sorted(FIXTURES.glob("*.json")):
        rec = json.loads(path.read_text())
        if rec["arch"] != arch:
            continue
        images = [procedural_image(w, h, s) for (w, h), s in zip(rec["image_sizes"], rec["image_seeds"])]
        prompt = {"prompt": rec["prompt"], "mm_processor_kwargs": {"fps": rec["fps"]},
                  "multi_modal_data": {"image": images, "video": [(FIXTURES / rec["video_file"]).read_bytes()]}}
        out.append((prompt, rec))
    return out


def _checked_cases(model_dir, arch):
    got = _cases(arch)
    sha = hashlib.sha256((model_dir / "model.safetensors").read_bytes()).hexdigest()
    assert got and all(rec["checkpoint_sha256"] == sha for _, rec in got)  # the fixtures' checkpoint
    return got


@pytest.fixture(scope="module")
def cases(qwen3_vl_tiny):
    return _checked_cases(qwen3_vl_tiny, "qwen3_vl")


@pytest.mark.parametrize("arch, chunk", [(a, c) for a in ("qwen3_vl", "qwen3_vl_moe", "qwen2_vl", "qwen2_5_vl")
                                         for c in (None, 7)],
                         ids=lambda v: v if isinstance(v, str) else (f"chunks-{v}" if v else "whole"))
def test_videos_match_transformers_golden_tokens(request, arch, chunk):
    model_dir = request.getfixturevalue(f"{arch}_tiny")
    cases = _checked_cases(model_dir, arch)
    llm = LLM(model=model_dir, device="cpu", **({"max_num_batched_tokens": chunk} if chunk else {}))
    outs = llm.generate([p for p, _ in cases], SamplingParams(max_tokens=10, ignore_eos=True))
    for (_, rec), out in zip(cases, outs):
        assert out.error is None
        assert out.num_prompt_tokens == len(rec["input_ids"])
        assert out.outputs[0].token_ids == rec["greedy_tokens"], rec["video_file"]
    assert all_blocks_free(llm.engine)


def test_one_encoder_run_per_video_and_sampling(qwen3_vl_tiny, cases):
    llm = LLM(model=qwen3_vl_tiny, device="cpu")
    prompt, rec = next((p, r) for p, r in cases if not r["image_sizes"])
    params = SamplingParams(max_tokens=3, ignore_eos=True)
    first = llm.generate([prompt, prompt], params)
    assert llm.engine.load_report()["encoder_runs"] == 1  # same bytes, same options: one entry
    assert first[0].outputs[0].token_ids == first[1].outputs[0].token_ids
    other = dict(prompt, mm_processor_kwargs={"fps": 4.0})
    llm.generate([other], params)
    assert llm.engine.load_report()["encoder_runs"] == 2  # other sampling: other features


def test_bad_video_fails_only_its_request(qwen3_vl_tiny, cases):
    llm = LLM(model=qwen3_vl_tiny, device="cpu")
    good, rec = cases[0]
    bad = {"prompt": f"bad {VID}", "multi_modal_data": {"video": [b"\x1aE\xdf\xa3 not really webm"]}}
    too_many = dict(good, mm_processor_kwargs={"max_frames": 10**6})
    outs = llm.generate([good, bad, too_many], SamplingParams(max_tokens=10, ignore_eos=True))
    assert outs[0].error is None and outs[0].outputs[0].token_ids == rec["greedy_tokens"]
    assert outs[1].error.startswith("video 1 is not a readable video (") and "max_frames" in outs[2].error


def test_chat_with_a_video_url_part(qwen3_vl_tiny, cases):
    import base64

    llm = LLM(model=qwen3_vl_tiny, device="cpu")
    prompt, rec = next((p, r) for p, r in cases if not r["image_sizes"])
    data = prompt["multi_modal_data"]["video"][0]
    url = "data:video/mp4;base64," + base64.b64encode(data).decode()
    messages = [{"role": "user", "content": [{"type": "video_url", "video_url": {"url": url}},
                                             {"type": "text", "text": "What happens?"}]}]
    out = llm.chat(messages, SamplingParams(max_tokens=4, ignore_eos=True))[0]
    assert out.error is None and len(out.outputs[0].token_ids) == 4
    assert out.num_vision_tokens == 2 * 6  # two temporal patches of 4x6 patches, merged 2x2
    bad = [{"role": "user", "content": [{"type": "video_url", "video_url": {"url": "https://x/v.mp4"}}]}]
    refused = llm.chat(bad)[0]  # fails alone, with .error, as a bad prompt to generate does
    assert refused.outputs[0].finish_reason == "error" and "video_url must be a data: URL" in refused.error
