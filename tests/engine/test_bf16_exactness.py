"""bf16 on the CPU (the fast path, `--dtype bfloat16`): greedy outputs equal transformers' own bf16
`generate` for the first 16 tokens, every family, text / one image / two images (issue 36's aim).
The native paged attention rounds as torch's CPU flash attention does in bf16, and the fused
layer operators as transformers' modules do, so the two agree token for token."""
import pytest
import torch

from epdserve import LLM, SamplingParams
from epdserve.model.demo_images import jpeg_bytes, procedural_image
from epdserve.model.reference import ReferenceGenerator
from tests.harness import PH

TOKENS = 16


def _img(w, h, seed):
    return jpeg_bytes(procedural_image(w, h, seed))


PROMPTS = [("the quick brown fox jumps over the lazy dog", []),
           (f"what is in {PH} here", [_img(112, 84, 1)]),
           (f"a {PH} b {PH} compare", [_img(112, 84, 2), _img(56, 140, 3)])]


@pytest.mark.parametrize("arch", ["qwen2_vl", "qwen2_5_vl", "qwen3_vl", "qwen3_vl_moe"])
def test_bf16_equals_transformers_bf16(request, arch):
    model_dir = request.getfixturevalue(f"{arch}_tiny")
    llm = LLM(model_dir, device="cpu", dtype="bfloat16")
    assert llm.engine.runner.ops.name == "native" and llm.engine.kv_cache.keys[0].dtype == torch.bfloat16
    ref = ReferenceGenerator(model_dir, dtype=torch.bfloat16)
    outs = llm.generate([{"prompt": p, "multi_modal_data": {"image": i}} if i else p for p, i in PROMPTS],
                        SamplingParams(max_tokens=TOKENS, ignore_eos=True))
    for (p, images), o in zip(PROMPTS, outs):
        assert o.error is None
        assert o.outputs[0].token_ids == ref.generate(p, images, TOKENS), (arch, p)
