"""Bad input fails only its own request with a clear error; the rest of the batch finishes."""
from tests.engine.blocks import all_blocks_free
from epdserve import LLM, SamplingParams
from epdserve.model.demo_images import jpeg_bytes, procedural_image
from tests.harness import PH


def test_bad_requests_fail_alone(qwen2_vl_tiny):
    llm = LLM(model=qwen2_vl_tiny, device="cpu", max_model_len=256)
    good_img = jpeg_bytes(procedural_image(84, 84, 1))
    prompts = [
        {"prompt": f"good {PH} one", "multi_modal_data": {"image": [good_img]}},
        {"prompt": f"corrupt {PH}", "multi_modal_data": {"image": [b"\xff\xd8\xff\xe0 not really a jpeg"]}},
        {"prompt": f"two placeholders {PH} {PH}", "multi_modal_data": {"image": [good_img]}},
        " ".join(["long"] * 400),
        "a fine text prompt",
    ]
    outs = llm.generate(prompts, SamplingParams(max_tokens=5, ignore_eos=True))
    assert [o.error is None for o in outs] == [True, False, False, False, True]
    assert outs[1].error.startswith("image 1 is not a readable image (") and "object at 0x" not in outs[1].error
    assert "2 image placeholder(s) but 1 image(s)" in outs[2].error
    assert "context is 256" in outs[3].error
    assert all(o.outputs[0].finish_reason == "error" for o in outs[1:4])
    assert len(outs[0].outputs[0].token_ids) == 5 and len(outs[4].outputs[0].token_ids) == 5
    assert all_blocks_free(llm.engine)


def test_output_truncated_at_context_length(qwen2_vl_tiny):
    llm = LLM(model=qwen2_vl_tiny, device="cpu", max_model_len=20)
    out = llm.generate("a b c d e", SamplingParams(max_tokens=100, ignore_eos=True))[0]
    assert out.outputs[0].finish_reason == "length"
    assert out.num_prompt_tokens + len(out.outputs[0].token_ids) == 20
