"""FP8 MoE experts (engine/lm/expert_linears.py, per_expert.py, fp8_parts.py; issue 49).

`--quantization fp8` holds each expert as its own `Fp8Linear` (one scale for its fused gate-up,
one for its down, activations per token); an FP8 checkpoint's experts, stored one module each
(`mlp.experts.{e}.{gate,up,down}_proj`, the layout of Qwen's block-wise and llm-compressor's
compressed-tensors Qwen3-VL-MoE checkpoints: engine/lm/per_expert.py), are read per rank as FP8
projections. The checkpoints are written here from the tiny MoE demo: its fused experts split into
per-expert modules, then quantized by tests/engine/test_fp8.py's and test_fp8_block.py's writers
(whose projection filter takes the per-expert names). A checkpoint whose experts stay fused in
float runs them dense, at TP1 too; what cannot run (part-FP8 experts, an FP8 router, fused FP8
experts) is refused naming the tensor.

Each expert projection: against the float64 product of its dequantized weights and the
fake-quantized activations, within test_fp8.py's fp32 bound (K + 3) · 2⁻²⁴ · R (bf16: 2⁻⁸ · R more).

End to end, the oracle is transformers on a checkpoint holding the dequantized weights (experts
re-fused into transformers' layout), each quantized projection's input fake-quantized as the engine
quantizes it: attention by test_fp8.py's pre-hooks, the experts by transformers' own expert loop
(modeling_qwen3_vl_moe.py `Qwen3VLMoeTextExperts.forward`, repeated below) with the expert's input
and its down_proj's input fake-quantized — a pre-hook cannot reach down's input inside that loop.
Then both sides multiply the same fp8 values and differ by fp32 summation order only: greedy
tokens equal but at a near tie of transformers' logits (test_fp8.py's `FP8_NEAR_TIE`, printed),
logprobs of the agreed tokens within `LOGPROB_TOL` — plus, per position, how far transformers' own
logprob moves when its decoder layers' inputs are perturbed at fp32-rounding level (relative
2⁻²², three seeded tries: `_flip_spread`, printed; measured only where `LOGPROB_TOL` alone is exceeded). That term is the fp8 rounding flip test_fp8.py
describes: a sum that differs in its last bits can cross an e4m3 rounding boundary, moving that
activation by one e4m3 step. Block-wise groups of 32 inputs hit one on this checkpoint: the engine
0.0043 off transformers at the first token of the text prompt, and transformers itself 0.0043 off
under two of four such perturbations (with one group per input row: 1e-7 and ~1e-7).
"""
from __future__ import annotations

import json
import re
import shutil
import types

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import load_file, save_file

from epdserve import LLM, SamplingParams
from epdserve.engine.lm.expert_linears import QUANTIZES_EXPERTS, expert_linears, expert_method
from epdserve.engine.lm.experts import ExpertShard
from epdserve.engine.lm.fp8_block_linear import Fp8BlockLinear, block_row_scales, dequantize_fp8_blocks
from epdserve.engine.lm.fp8_checkpoint import Fp8Scheme
from epdserve.engine.lm.fp8_linear import FP8, Fp8Linear, dequantize_fp8, dynamic_scale, quantize_fp8
from epdserve.instance.host import InstanceHost
from tests.engine.test_fp8 import (FP8_NEAR_TIE, LOGPROB_TOL, MODULES, TOKENS, _fused_key, _is_projection, _key,
                                   fp8_checkpoint, oracle_greedy)
from tests.engine.test_fp8_block import block_checkpoint
from tests.engine.test_quantization import PROMPTS
from tests.hf_oracle import HFOracle, assert_same_greedy

EXPERT = re.compile(r"^(.*\.mlp\.experts\.)(\d+)\.(gate|up|down)_proj\.weight$")
BLOCK = (32, 32)  # the tiny MoE: hidden 64, experts 32 wide: whole blocks everywhere


# ------------------------------------------------------------------ each expert's projections
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_each_fp8_expert_projection_equals_its_dequantized_product_within_fp32_rounding(dtype):
    """`--quantization fp8`'s experts: one `Fp8Linear` per expert, scale max|w_e| / 448 of that
    expert alone, activations per token; test_fp8.py's bound."""
    gen = torch.Generator().manual_seed(3)
    E, out, K = 4, 48, 96
    stacked = torch.randn(E, out, K, generator=gen) * (1.0 + torch.arange(E))[:, None, None]  # scales differ
    lins = expert_linears(stacked.to(dtype), "fp8", "gate_up_proj (hidden_size)")
    assert len(lins) == E and all(isinstance(lin, Fp8Linear) and lin.layout == "rowwise" for lin in lins)
    x = (torch.randn(5, K, generator=gen) * 4.0 ** (torch.arange(5) % 3)[:, None]).to(dtype)
    sx = dynamic_scale(x, per_token=True)
    xf = quantize_fp8(x, sx).double() * sx.double()
    for e, lin in enumerate(lins):
        s = stacked[e].to(dtype).float().abs().max() / 448
        torch.testing.assert_close(lin.row_scales, s.expand(out), rtol=0, atol=0)  # this expert's own scale
        w = dequantize_fp8(lin.q, lin.row_scales, torch.float64)
        got = lin(x)
        assert got.dtype == dtype
        want = xf @ w.t()
        R = xf.abs() @ w.abs().t()
        bound = (K + 3) * 2.0 ** -24 * R + (2.0 ** -8 * R if dtype == torch.bfloat16 else 0)
        err = (got.double() - want).abs()
        assert (err <= bound).all(), f"expert {e}: max excess {(err - bound).max():.3g}"
        assert ((x.double() @ stacked[e].double().t() - got.double()).abs() > bound).any()  # not a no-op


def test_fp8_quantizes_experts_and_a_checkpoints_own_method_does_not_requantize_fused_ones():
    assert "fp8" in QUANTIZES_EXPERTS and expert_method("fp8") == "fp8"
    assert expert_method("fp8", prequantized=True) == "dense"  # fused float experts of a block-wise checkpoint


# ------------------------------------------------------------------ checkpoints
def _unfuse(src, dst):
    """`src` (fused experts, transformers 5's [E, out, in]) with each layer's experts as their own
    modules: `mlp.experts.{e}.gate_proj` / `up_proj` [I, hidden] (gate_up's first / second half of
    rows), `down_proj` [hidden, I] — the FP8 checkpoints' layout (engine/lm/per_expert.py)."""
    shutil.copytree(src, dst)
    for f in dst.glob("*.safetensors"):
        out = {}
        for name, t in load_file(f).items():
            if name.endswith("mlp.experts.gate_up_proj"):
                for e, w in enumerate(t):
                    gate, up = w.chunk(2, dim=0)
                    out[f"{name[:-len('gate_up_proj')]}{e}.gate_proj.weight"] = gate.contiguous()
                    out[f"{name[:-len('gate_up_proj')]}{e}.up_proj.weight"] = up.contiguous()
            elif name.endswith("mlp.experts.down_proj"):
                for e, w in enumerate(t):
                    out[f"{name[:-len('down_proj')]}{e}.down_proj.weight"] = w.contiguous()
            else:
                out[name] = t
        save_file(out, f, metadata={"format": "pt"})
    return dst


def _refuse(tensors: dict) -> dict:
    """Per-expert float modules fused back into transformers' [E, out, in] experts."""
    experts: dict[str, dict[int, dict[str, torch.Tensor]]] = {}
    out = {}
    for name, t in tensors.items():
        m = EXPERT.match(name)
        if m:
            experts.setdefault(m[1], {}).setdefault(int(m[2]), {})[m[3]] = t
        else:
            out[name] = t
    for prefix, by_e in experts.items():
        order = sorted(by_e)
        out[prefix + "gate_up_proj"] = torch.stack([torch.cat([by_e[e]["gate"], by_e[e]["up"]]) for e in order])
        out[prefix + "down_proj"] = torch.stack([by_e[e]["down"] for e in order])
    return out


def _dequantized(ckpt, dst, block: tuple[int, int] | None):
    """transformers' checkpoint of `ckpt`'s dequantized weights (fp32; experts re-fused), no quantization_config."""
    shutil.copytree(ckpt, dst)
    for f in dst.glob("*.safetensors"):
        tensors = load_file(f)
        for name in [n for n in tensors if tensors[n].dtype == FP8]:
            base = name[: -len(".weight")]
            if block:
                rows = block_row_scales(tensors.pop(base + ".weight_scale_inv"), range(tensors[name].shape[0]), block[0])
                tensors[name] = dequantize_fp8_blocks(tensors[name], rows, block[1], torch.float32)
            else:
                tensors[name] = dequantize_fp8(tensors[name], tensors.pop(base + ".weight_scale"), torch.float32)
        save_file(_refuse(tensors), f, metadata={"format": "pt"})
    config = json.loads((dst / "config.json").read_text())
    config.pop("quantization_config", None)
    (dst / "config.json").write_text(json.dumps(config))
    return dst


def _per_token(rows: torch.Tensor) -> torch.Tensor:
    s = dynamic_scale(rows, per_token=True)
    return quantize_fp8(rows, s).float() * s


def _per_group(bk: int):
    def fq(rows: torch.Tensor) -> torch.Tensor:
        return torch.cat([_per_token(g) for g in rows.split(bk, dim=1)], dim=1)
    return fq


def _chunked(fq, chunks: int):
    """`fq` on each of `chunks` slices of the inputs (a TP rank's share of a row-parallel projection)."""
    return lambda rows: torch.cat([fq(part) for part in rows.chunk(chunks, dim=1)], dim=1)


def _fake_quantized_experts(self, hidden_states, top_k_index, top_k_weights):
    """transformers' `Qwen3VLMoeTextExperts.forward`, the expert's input and down_proj's input fake-quantized."""
    fq = self.fake_quant
    final_hidden_states = torch.zeros_like(hidden_states)
    with torch.no_grad():
        expert_mask = torch.nn.functional.one_hot(top_k_index, num_classes=self.num_experts + 1).permute(2, 1, 0)
        expert_hit = torch.greater(expert_mask.sum(dim=(-1, -2)), 0).nonzero()
    for expert_idx in expert_hit:
        expert_idx = expert_idx[0]
        if expert_idx == self.num_experts:
            continue
        top_k_pos, token_idx = torch.where(expert_mask[expert_idx])
        current_state = fq(hidden_states[token_idx].float()).to(hidden_states.dtype)
        gate, up = F.linear(current_state, self.gate_up_proj[expert_idx]).chunk(2, dim=-1)
        current = fq((self.act_fn(gate) * up).float()).to(hidden_states.dtype)
        current = F.linear(current, self.down_proj[expert_idx]) * top_k_weights[token_idx, top_k_pos, None]
        final_hidden_states.index_add_(0, token_idx, current.to(final_hidden_states.dtype))
    return final_hidden_states


def fake_quantized_oracle(dequantized, fq, tp: int = 1, attention_scales: dict[str, float] | None = None) -> HFOracle:
    """transformers on `dequantized`, every quantized projection's input fake-quantized by `fq`
    (attention's o_proj per TP slice); the experts whole (never split by their inputs)."""
    oracle = HFOracle(dequantized)

    def hook(f):
        def pre(_m, args):
            x = args[0]
            return (f(x.reshape(-1, x.shape[-1]).float()).reshape(x.shape).to(x.dtype), *args[1:])
        return pre

    for name, m in oracle.model.named_modules():
        if ".layers." in name and "visual" not in name and name.endswith(MODULES):
            m.register_forward_pre_hook(hook(_chunked(fq, tp) if name.endswith("o_proj") else fq))
        if ".layers." in name and "visual" not in name and name.endswith("mlp.experts"):
            m.fake_quant = fq
            m.forward = types.MethodType(_fake_quantized_experts, m)
    return oracle


def _flip_spread(oracle, prompt, imgs, want, ref, trials: int = 3) -> list[float]:
    """Per position, how far transformers' own logprob of `want`'s token moves when each decoder
    layer's input is perturbed at fp32-rounding level (relative 2⁻²², seeded): the size of an fp8
    rounding flip (module docstring) where one is that close, else ~0."""
    spread = [0.0] * len(want)
    layers = oracle.model.model.language_model.layers
    for trial in range(trials):
        gen = torch.Generator().manual_seed(trial)

        def nudge(_m, args, kwargs):
            x = args[0] if args else kwargs["hidden_states"]
            y = x * (1 + 2.0 ** -22 * torch.randn(x.shape, generator=gen)).to(x.dtype)
            if args:
                return (y, *args[1:]), kwargs
            return args, {**kwargs, "hidden_states": y}

        hooks = [layer.register_forward_pre_hook(nudge, with_kwargs=True) for layer in layers]
        try:
            tokens, _, lps = oracle_greedy(oracle, prompt, imgs)
        finally:
            for h in hooks:
                h.remove()
        for i, (t, w) in enumerate(zip(tokens, want)):
            if t != w:
                break
            spread[i] = max(spread[i], abs(lps[i] - ref[i]))
    return spread


def _check_generation(llm, oracle, what: str) -> None:
    """Greedy tokens equal transformers' but at a near tie (`FP8_NEAR_TIE`, printed); each agreed
    token's logprob within `LOGPROB_TOL` of its, plus — where that is exceeded — transformers' own
    flip spread there (printed): the engine's sums differ from transformers' by fp32 order, which can flip an
    activation's fp8 rounding just as the perturbation does."""
    inputs = [{"prompt": p, "multi_modal_data": {"image": imgs}} if imgs else p for p, imgs in PROMPTS]
    outs = llm.generate(inputs, SamplingParams(max_tokens=TOKENS, ignore_eos=True, logprobs=0))
    for (prompt, imgs), out in zip(PROMPTS, outs):
        got = list(out.outputs[0].token_ids)
        want, margins, ref = oracle_greedy(oracle, prompt, imgs)
        assert_same_greedy(got, want, margins, f"{what} {prompt[:20]!r}", FP8_NEAR_TIE)
        n = next((i for i, (g, w) in enumerate(zip(got, want)) if g != w), min(len(got), len(want)))
        diffs = [abs(out.outputs[0].logprobs[i].logprob - ref[i]) for i in range(n)]
        # transformers' own flip spread, only where the plain bound is exceeded (each try is a generate)
        spread = _flip_spread(oracle, prompt, imgs, want, ref) if any(d > LOGPROB_TOL for d in diffs) else [0.0] * n
        for i, d in enumerate(diffs):
            tol = LOGPROB_TOL + spread[i]
            print(f"{what} {prompt[:20]!r}: token {i} logprob differs by {d:.2g} (transformers' own flip spread "
                  f"{spread[i]:.2g})")
            assert d <= tol, f"{what}: token {i} logprob {d:.3g} off transformers' {ref[i]} (allowed {tol:.2g})"


def _sparse(llm) -> list[ExpertShard]:
    return [w.moe for w in llm.engine.model.lm.layers if w.moe is not None]


def test_quantization_fp8_at_load_holds_each_expert_in_fp8_and_equals_transformers(qwen3_vl_moe_tiny, tmp_path):
    """`LLM(quantization="fp8")` on the tiny MoE at TP1: attention by test_fp8.py's at-load rule (one
    scale per fused projection), each expert's gate-up and down by their own scale; the oracle holds
    those dequantized weights."""
    dst = tmp_path / "oracle"
    shutil.copytree(qwen3_vl_moe_tiny, dst)

    def roundtrip(w: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
        return dequantize_fp8(quantize_fp8(w, scale), scale.reshape(1), torch.float32)

    for f in dst.glob("*.safetensors"):
        tensors = load_file(f)
        names = [n for n in tensors if _is_projection(n)]
        amax: dict[str, float] = {}
        for n in names:
            k = _fused_key(_key(n))
            amax[k] = max(amax.get(k, 0.0), float(tensors[n].float().abs().max()))
        for n in names:
            tensors[n] = roundtrip(tensors[n], torch.tensor(amax[_fused_key(_key(n))]) / 448)
        for n in [n for n in tensors if n.endswith(("mlp.experts.gate_up_proj", "mlp.experts.down_proj"))]:
            tensors[n] = torch.stack([roundtrip(w, w.float().abs().max() / 448) for w in tensors[n]])
        save_file(tensors, f, metadata={"format": "pt"})
    oracle = fake_quantized_oracle(dst, _per_token)
    llm = LLM(qwen3_vl_moe_tiny, device="cpu", dtype="float32", quantization="fp8", kv_cache_bytes=32 << 20)
    try:
        sparse = _sparse(llm)
        assert sparse and all(m.num_local == 8 and m.method == "fp8" for m in sparse)
        assert all(isinstance(lin, Fp8Linear) for m in sparse for lin in m.gate_up + m.down)
        assert InstanceHost.weights_method(types.SimpleNamespace(model=llm.engine.model)) == "fp8(experts:fp8)"
        _check_generation(llm, oracle, "--quantization fp8 MoE")
    finally:
        llm.engine.close()


CASES = [("block", 1), ("channel", 2)]  # TP1 read by the block case, the ranks' expert ranges by the channel one


@pytest.mark.parametrize("kind, tp", CASES, ids=[f"{k}-tp{t}" for k, t in CASES])
def test_an_fp8_moe_checkpoint_with_per_expert_modules_equals_transformers(qwen3_vl_moe_tiny, tmp_path, kind, tp):
    """Qwen's block-wise layout (`weight_scale_inv` per [32, 32] block) and llm-compressor's
    compressed-tensors one (`weight_scale` per channel, activations per token), experts one module
    each: block-wise at TP1 (the shard loader reads them: no refusal any more), compressed-tensors at
    TP2 (each rank its 4 experts)."""
    unfused = _unfuse(qwen3_vl_moe_tiny, tmp_path / "unfused")
    if kind == "block":
        ckpt, block, fq, method = block_checkpoint(unfused, tmp_path / "fp8", BLOCK), BLOCK, _per_group(32), "fp8"
    else:
        ckpt = fp8_checkpoint(unfused, tmp_path / "fp8", Fp8Scheme("channel", "token"))
        block, fq, method = None, _per_token, "compressed-tensors"
    first = next(n for f in ckpt.glob("*.safetensors") for n, t in load_file(f).items() if EXPERT.match(n))
    assert load_file(next(ckpt.glob("*.safetensors")))[first].dtype == FP8  # the writers quantized the experts
    oracle = fake_quantized_oracle(_dequantized(ckpt, tmp_path / "oracle", block), fq, tp)
    llm = LLM(str(ckpt), device="cpu", dtype="float32", tensor_parallel_size=tp, kv_cache_bytes=32 << 20)
    try:
        assert llm.engine.model.quantization == method
        sparse = _sparse(llm)
        want = Fp8BlockLinear if block else Fp8Linear
        assert sparse and all(m.num_local == 8 // tp and m.method == method for m in sparse)
        assert all(isinstance(lin, want) for m in sparse for lin in m.gate_up + m.down)
        assert InstanceHost.weights_method(types.SimpleNamespace(model=llm.engine.model)) == f"{method}(experts:{method})"
        _check_generation(llm, oracle, f"{kind} FP8 MoE checkpoint TP{tp}")
    finally:
        llm.engine.close()


def test_what_cannot_run_as_fp8_experts_is_refused_at_start_up(qwen3_vl_moe_tiny, tmp_path):
    """Experts fused into FP8 [E, ...] tensors (transformers' `FP8Experts` layout: not read), an FP8
    router, and a layer whose experts are part FP8, part float: each refused naming the tensor."""
    ckpt = fp8_checkpoint(_unfuse(qwen3_vl_moe_tiny, tmp_path / "unfused"), tmp_path / "fp8",
                          Fp8Scheme("channel", "token"))
    f = next(ckpt.glob("*.safetensors"))
    tensors = load_file(f)
    p = "model.language_model.layers.0.mlp."
    up = p + "experts.1.up_proj.weight"
    mixed = {**tensors, up: dequantize_fp8(tensors[up], tensors[up[:-len("weight")] + "weight_scale"], torch.float32)}
    save_file(mixed, f, metadata={"format": "pt"})
    with pytest.raises(ValueError, match=r"layers\.0\.mlp\.experts: some expert projections are FP8 and some are not"):
        LLM(str(ckpt), device="cpu", dtype="float32", kv_cache_bytes=32 << 20)
    save_file({**tensors, p + "gate.weight": tensors[p + "gate.weight"].to(FP8)}, f, metadata={"format": "pt"})
    with pytest.raises(ValueError, match=r"layers\.0\.mlp\.gate\.weight is FP8; epdserve runs FP8 only in"):
        LLM(str(ckpt), device="cpu", dtype="float32", kv_cache_bytes=32 << 20)
    fused = {n: t for n, t in tensors.items() if ".layers.0.mlp.experts." not in n}
    fused[p + "experts.gate_up_proj"] = torch.zeros(8, 64, 64).to(FP8)
    fused[p + "experts.down_proj"] = torch.zeros(8, 64, 32).to(FP8)
    save_file(fused, f, metadata={"format": "pt"})
    with pytest.raises(ValueError, match=r"experts\.(gate_up|down)_proj is FP8; .*stored one module each"):
        LLM(str(ckpt), device="cpu", dtype="float32", kv_cache_bytes=32 << 20)


def test_an_fp8_checkpoint_whose_experts_stay_fused_in_float_runs_them_dense_at_tp1(qwen3_vl_moe_tiny, tmp_path):
    """Experts the checkpoint left in float, fused as transformers holds them: the shard loader reads
    the layers at TP1 too (attention FP8) and holds those experts dense, never re-quantized."""
    from epdserve.engine.lm.expert_linears import DenseExpert

    ckpt = fp8_checkpoint(qwen3_vl_moe_tiny, tmp_path / "fp8", Fp8Scheme("channel", "token"))
    llm = LLM(str(ckpt), device="cpu", dtype="float32", kv_cache_bytes=32 << 20)
    try:
        layers = llm.engine.model.lm.layers
        assert layers and all(isinstance(w.qkv, Fp8Linear) for w in layers)
        assert all(isinstance(lin, DenseExpert) for w in layers for lin in w.moe.gate_up + w.moe.down)
        assert InstanceHost.weights_method(types.SimpleNamespace(model=llm.engine.model)) == \
            "compressed-tensors(experts:dense)"
    finally:
        llm.engine.close()


def test_doctor_says_fp8_holds_the_experts_too():
    from epdserve.checks.doctor import Status, _quantization

    at_load = _quantization(types.SimpleNamespace(name="cpu"), "fp8")  # only the platform's name is read
    assert at_load.status is Status.OK and "MoE experts included (each expert on its own, by fp8 too" in at_load.detail
    checkpoint = _quantization(types.SimpleNamespace(name="cpu"), "compressed-tensors")
    assert checkpoint.status is Status.OK and "MoE experts stored one module each" in checkpoint.detail
