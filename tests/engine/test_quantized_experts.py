"""Quantized MoE experts (engine/lm/expert_linears.py, issue 49): `--quantization` holds a
Qwen3-VL-MoE layer's experts as the dense linears are held, one projection per expert. Each
expert's projections within the kernel's rounding bound of a float product with that expert's
dequantized weights (every method, both routes of int8, fp32 and bf16); a whole layer within a bound
propagated from those through silu·up, down and the weighted sum, of a float64 reference on the
dequantized weights; the dense layer bit for bit transformers' own block (its expert order);
transformers' own layer held by a method holding its experts so too; the ranks' expert shards
summing to the whole layer (expert parallelism); greedy outputs of the
tiny MoE demo (int8, TP1) and of a 128-wide one (int4, TP1 and TP2)
equal transformers' `generate` on a checkpoint holding the dequantized weights, experts included (a
part only at a near tie of transformers' own logits, printed), the first token's log probabilities
within 1e-4 of its; int4 refused at start-up, naming
the experts' width, where moe_intermediate_size is not whole groups of 128."""
from __future__ import annotations

from dataclasses import replace
from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F

from epdserve import LLM, SamplingParams
from epdserve.engine.lm.expert_linears import DenseExpert, expert_linears
from epdserve.engine.lm.experts import ExpertShard
from epdserve.engine.lm.int4_linear import GROUP_SIZE, Int4Linear, dequantize_int4, quantize_int4
from epdserve.engine.lm.quant_linear import (PACKED_MAX_ROWS, Int8DynamicLinear, Int8Linear, quantize_int8,
                                             quantize_rows)
from epdserve.engine.lm.weights import layer_weights
from epdserve.engine.loaded_model import _check_shard
from epdserve.engine.tp.shard import TPShard
from epdserve.instance.host import InstanceHost
from epdserve.model.demo import PRESETS, build_demo_model
from epdserve.model.demo_qwen3 import QWEN3_PRESETS
from tests.engine.test_quantization import PROMPTS, dequantized_checkpoint, int8_roundtrip
from tests.hf_oracle import NEAR_TIE, HFOracle, assert_same_greedy

TOKENS = 8
METHODS = {"int8": Int8Linear, "w8a8": Int8DynamicLinear, "int4": Int4Linear}
E, TOP_K, HIDDEN, INTER = 4, 3, 256, 128  # gate_up: K = 256, down: K = 128 (whole int4 groups)
U = 2 ** -24  # fp32's unit roundoff


def int4_roundtrip(w: torch.Tensor) -> torch.Tensor:
    return dequantize_int4(*quantize_int4(w), w.dtype)


ROUNDTRIP = {"int8": int8_roundtrip, "w8a8": int8_roundtrip, "int4": int4_roundtrip}


def _experts(dtype, seed=0):
    """(router [E, H], gate_up [E, 2I, H], down [E, H, I]) drawn as the demo draws them."""
    gen = torch.Generator().manual_seed(seed)
    router = torch.randn(E, HIDDEN, generator=gen).mul(HIDDEN ** -0.5)
    gate_up = torch.randn(E, 2 * INTER, HIDDEN, generator=gen).mul(1.5 * HIDDEN ** -0.5)
    down = torch.randn(E, HIDDEN, INTER, generator=gen).mul(1.5 * INTER ** -0.5)
    return router.to(dtype), gate_up.to(dtype), down.to(dtype)


def _rows(n, k, dtype, seed):
    """n rows of k inputs of different magnitudes (1x to 64x): a scale shared by the rows would show."""
    gen = torch.Generator().manual_seed(seed)
    return (torch.randn(n, k, generator=gen) * 4.0 ** (torch.arange(n) % 4)[:, None]).to(dtype)


def _kernel_bound(method, dtype, K, R):
    """The dense tests' bounds (test_quantization.py, test_int4.py): fp32 accumulation in any order
    within K·u·R (int4: twice, its weight rebuilt in fp32); bf16 rounds the output and its scaling
    (int8: 2⁻⁷·R) or the rebuilt weight and the output (int4: 2⁻⁶·R)."""
    bf16 = dtype == torch.bfloat16
    if method == "int4":
        return 2 * K * U * R + (2 ** -6 * R if bf16 else 0)
    return K * U * R + (2 ** -7 * R if bf16 else 0)


@pytest.mark.parametrize("method", METHODS)
@pytest.mark.parametrize("dtype, rows", [(torch.float32, 3), (torch.float32, 40), (torch.bfloat16, 3),
                                         (torch.bfloat16, PACKED_MAX_ROWS + 28)])
def test_each_expert_projection_equals_its_dequantized_weights_within_the_rounding_bound(method, dtype, rows):
    """Every local expert's gate_up and down: out = x' · dequant(W_e)ᵀ (x' = x, or for w8a8 its
    per-token fake quantization), W_e quantized from that expert's weights alone."""
    router, gate_up, down = _experts(dtype)
    shard = ExpertShard(router, gate_up, down, first=0, top_k=TOP_K, method=method)
    assert shard.method == method and shard.num_local == E
    for lins, stacked in ((shard.gate_up, gate_up), (shard.down, down)):
        K = stacked.shape[2]
        x = _rows(rows, K, dtype, seed=K + rows)
        for e, (lin, w) in enumerate(zip(lins, stacked)):
            assert isinstance(lin, METHODS[method])
            deq = ROUNDTRIP[method](w).float()
            if method != "int4":  # what it holds is expert e's own quantization
                q, scales = quantize_int8(w)
                assert torch.equal(lin.q, q) and torch.equal(lin.scales.to(dtype), scales)
            got = lin(x)
            assert got.dtype == dtype
            xr = x.float()
            if method == "w8a8":
                xq, sx = quantize_rows(x)
                xr = xq.float() * sx
            want = xr @ deq.t()
            R = xr.abs() @ deq.abs().t()
            bound = _kernel_bound(method, dtype, K, R)
            err = (got.float() - want).abs()
            assert (err <= bound).all(), f"expert {e} K={K}: max excess {(err - bound).max():.3g}"
            assert not torch.equal(got, F.linear(x, w))  # quantized: not the model-dtype weights' answer


def _routing(shard, x):
    """The shard's routing, recomputed (the same fp32 ops): top-k experts and weights per token."""
    probs = torch.softmax(F.linear(x, shard.router), dtype=torch.float, dim=-1)
    weights, experts = torch.topk(probs, shard.top_k, dim=-1)
    weights /= weights.sum(dim=-1, keepdim=True)
    return experts, weights.to(x.dtype)


@pytest.mark.parametrize("method", ["int8", "int4"])
def test_a_quantized_layer_equals_a_float64_reference_on_the_dequantized_weights_within_the_propagated_bound(method):
    """fp32. Per token t and each of its experts e (weight w): g, u = x·Gᵀ, x·Uᵀ; h = silu(g)·u;
    y = h·Dᵀ, with G, U, D expert e's dequantized weights; out = Σ w·y. With δ = each projection's
    kernel bound (`_kernel_bound`, relative to R = |input|·|W|ᵀ): |g̃ - g| ≤ εg = δ·|x|·|G|ᵀ (εu
    alike); silu is 1.1-Lipschitz and fp32's silu and product round within 2⁻²⁰ relative, so
    |h̃ - h| ≤ εh = 1.1·εg·(|u| + εu) + |silu(g)|·εu + 2⁻²⁰·(|silu(g)| + 1.1·εg)·(|u| + εu); then
    |ỹ - y| ≤ δ_D·(|h| + εh)·|D|ᵀ + εh·|D|ᵀ; the weighting and the k-term sum add (k + 1)·u·Σ w·(|y| + that)."""
    router, gate_up, down = _experts(torch.float32, seed=1)
    shard = ExpertShard(router, gate_up, down, first=0, top_k=TOP_K, method=method)
    x = _rows(24, HIDDEN, torch.float32, seed=2)
    got = shard(x).double()
    experts, weights = _routing(shard, x)
    want = torch.zeros_like(got)
    bound = torch.zeros_like(got)
    for t in range(x.shape[0]):
        xt = x[t].double()
        for e, w in zip(experts[t].tolist(), weights[t].double().tolist()):
            G, Uw = ROUNDTRIP[method](gate_up[e]).double().chunk(2, dim=0)
            D = ROUNDTRIP[method](down[e]).double()
            g, u = G @ xt, Uw @ xt
            eg = _kernel_bound(method, torch.float32, HIDDEN, G.abs() @ xt.abs())
            eu = _kernel_bound(method, torch.float32, HIDDEN, Uw.abs() @ xt.abs())
            s = F.silu(g)
            h = s * u
            eh = 1.1 * eg * (u.abs() + eu) + s.abs() * eu + 2 ** -20 * (s.abs() + 1.1 * eg) * (u.abs() + eu)
            y = D @ h
            ey = _kernel_bound(method, torch.float32, INTER, D.abs() @ (h.abs() + eh)) + D.abs() @ eh
            want[t] += w * y
            bound[t] += w * ey + (TOP_K + 1) * U * w * (y.abs() + ey)
    err = (got - want).abs()
    assert (err <= bound).all(), f"max excess {(err - bound).max():.3g}"
    # the bound is tight enough to tell the quantized weights from the checkpoint's own
    dense = ExpertShard(router, gate_up, down, first=0, top_k=TOP_K)(x).double()
    assert not ((dense - want).abs() <= bound).all()


def _config():
    from transformers import Qwen3VLMoeTextConfig

    return Qwen3VLMoeTextConfig(hidden_size=HIDDEN, moe_intermediate_size=INTER, num_experts=E, num_experts_per_tok=TOP_K,
                                hidden_act="silu", num_attention_heads=4, num_key_value_heads=2, head_dim=64)


def test_the_dense_layer_is_transformers_block_bit_for_bit():
    """The order every method shares (ascending experts, by top-k slot then token, `index_add_`):
    with top-k 3 of 4 a sum in another order would show in fp32's last bits."""
    from transformers.models.qwen3_vl_moe.modeling_qwen3_vl_moe import Qwen3VLMoeTextSparseMoeBlock

    router, gate_up, down = _experts(torch.float32, seed=3)
    block = Qwen3VLMoeTextSparseMoeBlock(_config()).eval()
    with torch.no_grad():
        block.gate.weight.copy_(router)
        block.experts.gate_up_proj.copy_(gate_up)
        block.experts.down_proj.copy_(down)
        x = _rows(32, HIDDEN, torch.float32, seed=4)
        want = block(x[None])[0]
    shard = ExpertShard(router, gate_up, down, first=0, top_k=TOP_K)
    assert all(isinstance(lin, DenseExpert) for lin in shard.gate_up + shard.down)
    assert torch.equal(shard(x), want)


@pytest.mark.parametrize("method", ["dense", "int8"])
def test_transformers_own_layer_held_by_a_method_holds_its_experts_so_too(method):
    """engine/lm/weights.py `layer_weights`: dense keeps transformers' block as it is; a method makes it an
    ExpertShard of every expert held by that method (as engine/lm/shard_loader.py reads one)."""
    from transformers.models.qwen3_vl_moe.modeling_qwen3_vl_moe import Qwen3VLMoeTextDecoderLayer

    layer = Qwen3VLMoeTextDecoderLayer(_config(), 0).eval()
    router, gate_up, down = _experts(torch.float32, seed=7)
    with torch.no_grad():
        layer.mlp.gate.weight.copy_(router)
        layer.mlp.experts.gate_up_proj.copy_(gate_up)
        layer.mlp.experts.down_proj.copy_(down)
    moe = layer_weights(layer, method).moe
    if method == "dense":
        assert moe is layer.mlp
        return
    assert isinstance(moe, ExpertShard) and moe.method == method and moe.num_local == E
    x = _rows(20, HIDDEN, torch.float32, seed=8)
    assert torch.equal(moe(x), ExpertShard(router, gate_up, down, first=0, top_k=TOP_K, method=method)(x))


def test_a_quantized_sparse_model_is_read_by_the_shard_loader_at_tp1(qwen3_vl_moe_tiny):
    """Dense at TP1 it keeps transformers' expert block; quantized, its layers are read from the files (the
    full-precision decoder layers never built)."""
    assert not _check_shard(str(qwen3_vl_moe_tiny), TPShard(0, 1), "dense")
    assert _check_shard(str(qwen3_vl_moe_tiny), TPShard(0, 1), "int8")


@pytest.mark.parametrize("method", METHODS)
def test_the_ranks_expert_shards_sum_to_the_whole_layer(method):
    """Expert parallelism: rank r of 2 quantizes and applies experts [2r, 2r + 2) only; with top-2
    routing each token's sum is one or two terms, so the ranks' parts add up to one rank's layer exactly."""
    router, gate_up, down = _experts(torch.float32, seed=5)
    x = _rows(30, HIDDEN, torch.float32, seed=6)
    whole = ExpertShard(router, gate_up, down, first=0, top_k=2, method=method)(x)
    ranks = [ExpertShard(router, gate_up[r * 2:r * 2 + 2], down[r * 2:r * 2 + 2], first=r * 2, top_k=2, method=method)
             for r in (0, 1)]
    assert all(m.num_local == 2 for m in ranks)
    parts = [m(x) for m in ranks]
    assert all(p.abs().sum() > 0 for p in parts) and torch.equal(parts[0] + parts[1], whole)


def test_int4_refuses_expert_widths_that_are_not_whole_groups_naming_them():
    with pytest.raises(ValueError, match=rf"groups of {GROUP_SIZE}, but the MoE experts' down_proj takes 96 inputs"):
        expert_linears(torch.randn(2, 64, 96), "int4", "down_proj")
    assert len(expert_linears(torch.randn(2, 64, 96), "int8", "down_proj")) == 2  # int8 has no groups


def _moe_128(tmp_path_factory, name: str, moe_intermediate: int):
    """The tiny MoE demo 128 wide (hidden 128, 4 heads of 64: int4's groups fit every projection, and
    o's rank share at TP2), experts `moe_intermediate` wide."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setitem(PRESETS, "tiny", replace(PRESETS["tiny"], hidden=128))
        mp.setitem(QWEN3_PRESETS, "tiny", replace(QWEN3_PRESETS["tiny"], head_dim=64, mrope_section=(16, 8, 8),
                                                  moe_intermediate=moe_intermediate))
        return build_demo_model(tmp_path_factory.mktemp(name), arch="qwen3_vl_moe", size="tiny", seed=0)


@pytest.fixture(scope="module")
def moe_128(tmp_path_factory):
    return _moe_128(tmp_path_factory, "moe_128", GROUP_SIZE)


# int8 at TP2 is left to the unit test below: each rank quantizes its slice of o_proj's inputs with a scale of
# its own, so the whole-row dequantized oracle is not what a TP2 rank computes with (int4's groups lie within
# the slices: it is)
LOGPROB_TOL = 1e-4  # fp32 logits summed in another order: 2e-6 seen; experts left unquantized: 0.1
CASES = [("int8", "qwen3_vl_moe_tiny", 1), ("int4", "moe_128", 1), ("int4", "moe_128", 2)]


@pytest.mark.parametrize("method, model, tp", CASES, ids=[f"{m}-{c}-tp{t}" for m, c, t in CASES])
def test_greedy_outputs_equal_transformers_on_the_dequantized_experts(request, tmp_path, method, model, tp):
    src = request.getfixturevalue(model)
    oracle = HFOracle(dequantized_checkpoint(src, tmp_path / "dequantized", ROUNDTRIP[method]))
    llm = LLM(src, device="cpu", dtype="float32", quantization=method, tensor_parallel_size=tp,
              kv_cache_bytes=32 << 20)
    try:
        sparse = [w.moe for w in llm.engine.model.lm.layers if w.moe is not None]
        num_experts = llm.engine.model.adapter.text_config.num_experts
        assert sparse and all(isinstance(m, ExpertShard) and m.num_local == num_experts // tp for m in sparse)
        assert all(isinstance(lin, METHODS[method]) for m in sparse for lin in m.gate_up + m.down)
        assert InstanceHost.weights_method(SimpleNamespace(model=llm.engine.model)) == f"{method}(experts:{method})"
        inputs = [{"prompt": p, "multi_modal_data": {"image": imgs}} if imgs else p for p, imgs in PROMPTS]
        outs = llm.generate(inputs, SamplingParams(max_tokens=TOKENS, ignore_eos=True, logprobs=5))
        for (prompt, imgs), out in zip(PROMPTS, outs):
            want, margins = oracle.generate_with_margins(prompt, imgs, TOKENS)
            assert_same_greedy(out.outputs[0].token_ids, want, margins, f"{method} TP{tp} {prompt[:20]!r}", NEAR_TIE)
            # the first token's top-5 log probabilities, on the same prompt: the greedy tokens alone would not
            # tell experts left unquantized (1e-1 off on these checkpoints) from quantized ones (2e-6 off)
            first = out.outputs[0].logprobs[0]
            with torch.inference_mode():
                lp = torch.log_softmax(oracle.model(**oracle.inputs(prompt, imgs)).logits[0, -1].float(), dim=-1)
            err = (torch.tensor(first.top_logprobs) - lp[list(first.top_ids)]).abs().max()
            assert err <= LOGPROB_TOL, f"{method} TP{tp} {prompt[:20]!r}: first token's logprobs {err:.3g} off"
    finally:
        llm.engine.close()


def test_int4_with_experts_not_whole_groups_is_refused_at_start_up(tmp_path_factory):
    src = _moe_128(tmp_path_factory, "moe_128_narrow", 32)  # attention and router fit; the experts' down does not
    with pytest.raises(ValueError, match=r"MoE experts' down_proj \(moe_intermediate_size\) takes 32 inputs.*use int8"):
        LLM(src, device="cpu", dtype="float32", quantization="int4", kv_cache_bytes=32 << 20)
