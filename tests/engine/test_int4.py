"""Int4 weight-only quantization (`--quantization int4`, engine/lm/int4_linear.py, issue 49): the
kernel against a float product of the dequantized weights within a bound derived from its
arithmetic; a projection whose inputs on a rank are not whole groups refused, naming why; greedy
outputs at TP1 and TP2 equal transformers' `generate` on a checkpoint holding the dequantized
weights (the small demo checkpoint: the tiny one's 64-wide layers are not whole groups of 128)."""
from __future__ import annotations

import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from epdserve import LLM, SamplingParams
from epdserve.engine.lm.int4_linear import GROUP_SIZE, Int4Linear, dequantize_int4, quantize_int4
from epdserve.engine.lm.linear import DenseLinear, make_linear
from epdserve.model.demo import build_demo_model
from epdserve.model.demo_images import jpeg_bytes, procedural_image
from tests.harness import PH
from tests.hf_oracle import NEAR_TIE, HFOracle, assert_same_greedy

TOKENS = 8
QUANTIZED = ("self_attn.q_proj.weight", "self_attn.k_proj.weight", "self_attn.v_proj.weight",
             "self_attn.o_proj.weight", "mlp.gate_proj.weight", "mlp.up_proj.weight", "mlp.down_proj.weight")
PROMPTS = [("the quick brown fox jumps over the lazy dog", []),
           (f"what is in {PH} here", [jpeg_bytes(procedural_image(112, 84, 1))])]


@pytest.mark.parametrize("dtype, rows", [(torch.float32, 1), (torch.float32, 37), (torch.bfloat16, 1),
                                         (torch.bfloat16, 300)])
def test_int4_linear_equals_the_dequantized_weights_within_the_rounding_bound(dtype, rows):
    """Fused parts with a bias on one: out = x · dequant(W)ᵀ + b. Per output element, with
    R = |x| · |dequant(W)|ᵀ + |b|: fp32 accumulation in any order is within K · 2⁻²⁴ · R (twice
    that for the weight the kernel rebuilds in fp32 from code, scale and zero); a bf16 call also
    rounds the rebuilt weight and the output (each ≤ 2⁻⁸ relative), so within 2⁻⁶ · R more."""
    gen = torch.Generator().manual_seed(rows)
    K = 2 * GROUP_SIZE
    parts = [torch.randn(n, K, generator=gen).mul(0.05).to(dtype) for n in (64, 32, 32)]
    biases = [torch.randn(64, generator=gen).to(dtype), None, None]
    lin = make_linear(parts, biases, "int4")
    assert isinstance(lin, Int4Linear) and lin.packed.dtype == torch.uint8 and lin.out_features == 128
    w = torch.cat([p.float() for p in parts])
    q, scales, zeros = quantize_int4(torch.cat(parts), GROUP_SIZE)
    deq = dequantize_int4(q, scales, zeros, torch.float32)
    # the quantization itself: each weight within half a step of its group's scale (2⁻⁸ more: the rounded scale)
    step = scales.float().repeat_interleave(GROUP_SIZE, dim=1)
    assert ((w - deq).abs() <= step * (0.5 + 2 ** -7)).all()
    assert q.min() >= 0 and q.max() <= 15
    x = (torch.randn(rows, K, generator=gen) * 4.0 ** (torch.arange(rows) % 4)[:, None]).to(dtype)
    got = lin(x).float()
    bias = torch.cat([biases[0].float(), torch.zeros(64)])
    want = x.float() @ deq.t() + bias
    R = x.float().abs() @ deq.abs().t() + bias.abs()
    bound = 2 * K * 2 ** -24 * R + (2 ** -6 * R if dtype == torch.bfloat16 else 0)
    assert ((got - want).abs() <= bound).all(), f"max excess {((got - want).abs() - bound).max():.3g}"
    assert lin(x).dtype == dtype
    assert not torch.equal(lin(x), DenseLinear(parts, biases)(x))  # int4 is not a no-op


def test_a_rank_whose_inputs_are_not_whole_groups_is_refused_naming_why():
    with pytest.raises(ValueError, match=f"groups of {GROUP_SIZE}, but this projection takes 96 on its rank"):
        make_linear([torch.randn(32, 96)], None, "int4")


@pytest.fixture(scope="module")
def qwen2_vl_small(tmp_path_factory):
    return build_demo_model(tmp_path_factory.mktemp("qwen2_vl_small"), arch="qwen2_vl", size="small", seed=0)


def dequantized_checkpoint(src, dst):
    """A copy of `src` whose LM decoder projections hold dequantize(quantize(W)) (int4, groups of
    128) in their own dtype: the weights the int4 engine computes with."""
    shutil.copytree(src, dst)
    for f in dst.glob("*.safetensors"):
        tensors = load_file(f)
        for name, t in tensors.items():
            if ".layers." in name and "visual" not in name and name.endswith(QUANTIZED):
                tensors[name] = dequantize_int4(*quantize_int4(t), t.dtype).contiguous()
        save_file(tensors, f, metadata={"format": "pt"})
    return dst


@pytest.mark.parametrize("tp", [1, 2])
def test_greedy_outputs_equal_transformers_on_the_dequantized_int4_weights(qwen2_vl_small, tmp_path, tp):
    oracle = HFOracle(dequantized_checkpoint(qwen2_vl_small, tmp_path / "dequantized"))
    llm = LLM(qwen2_vl_small, device="cpu", dtype="float32", quantization="int4", tensor_parallel_size=tp,
              kv_cache_bytes=32 << 20)
    try:
        layer = llm.engine.model.lm.layers[0]
        assert isinstance(layer.qkv, Int4Linear) and isinstance(layer.o, Int4Linear)
        assert llm.engine.kv_layout().quantization == "int4"
        inputs = [{"prompt": p, "multi_modal_data": {"image": imgs}} if imgs else p for p, imgs in PROMPTS]
        outs = llm.generate(inputs, SamplingParams(max_tokens=TOKENS, ignore_eos=True))
        for (prompt, imgs), out in zip(PROMPTS, outs):
            want, margins = oracle.generate_with_margins(prompt, imgs, TOKENS)
            assert_same_greedy(out.outputs[0].token_ids, want, margins, f"int4 TP{tp} {prompt[:20]!r}", NEAR_TIE)
    finally:
        llm.engine.close()
