"""FP8 (engine/lm/fp8_linear.py, fp8_checkpoint.py, fp8_device.py; issue 49): compressed-tensors FP8
checkpoints (block-wise ones: tests/engine/test_fp8_block.py), written here from the tiny demo
models as llm-compressor writes them (config.json's `quantization_config`, each LM projection's
`weight` float8_e4m3fn [out, in] with `weight_scale` [out, 1] per channel or [1] per tensor, and
`input_scale` [1] for static activations; the vision tower and LM head left in float, as the
"ignore" list says), and `--quantization fp8` at load.

The kernel: against the float product of the dequantized weights and the fake-quantized
activations (the very values `_scaled_mm` multiplies), within fp32 rounding (bound below).

End to end, the oracle is transformers on a checkpoint holding the dequantized weights (q · scale,
in fp32) with each quantized projection's input fake-quantized by a forward pre-hook exactly as the
engine quantizes it (per token at run time, each tensor-parallel slice of a row-parallel input on
its own; or per tensor with the fused projection's largest input scale). The engine and the oracle
then multiply the same fp8-representable values; products of two e4m3 values are exact in fp32 (4
+ 4 significant bits), so the sums differ only in fp32 summation order — unless such a difference
moves an activation across an fp8 rounding boundary, which changes it by one e4m3 step (up to
2⁻³ of its magnitude; 2⁻⁴ is the rounding's bound). So: logprobs of each agreed token within
`LOGPROB_TOL` and greedy tokens equal, parting only where transformers' top two logits are within
`FP8_NEAR_TIE` (reported, never hidden)."""
from __future__ import annotations

import json
import re
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from epdserve import LLM, SamplingParams
from epdserve.engine.lm.fp8_checkpoint import Fp8Scheme, read_fp8_scheme
from epdserve.engine.lm.fp8_device import check_fp8_device, fp8_capability_refusal
from epdserve.engine.lm.fp8_linear import FP8, Fp8Linear, dequantize_fp8, dynamic_scale, quantize_fp8
from epdserve.engine.lm.linear import check_method, make_linear
from tests.engine.test_quantization import PROMPTS, QUANTIZED, W8A8_NEAR_TIE
from tests.hf_oracle import NEAR_TIE, HFOracle, assert_same_greedy

TOKENS = 8
PER_EXPERT = re.compile(r"\.mlp\.experts\.\d+\.(gate|up|down)_proj\.weight$")
MODULES = tuple(n.rsplit(".", 1)[0] for n in QUANTIZED)
FUSED = {"k_proj": "q_proj", "v_proj": "q_proj", "up_proj": "gate_proj"}  # part -> the fused projection's first
# Where an fp32 reduction-order difference flips an activation's fp8 rounding (module docstring), outputs may
# part: allowed only where transformers' top two logits are within this (w8a8's figure, the same mechanism;
# no parting was seen on these checkpoints)
FP8_NEAR_TIE = W8A8_NEAR_TIE
# With the same fp8 values on both sides a logit differs by fp32 reduction order only: the suite's bound for
# that (hf_oracle NEAR_TIE, 1e-4), twice, since a logprob is a logit minus a log-sum-exp (1.8e-6 seen)
LOGPROB_TOL = 2 * NEAR_TIE


def _is_projection(name: str) -> bool:
    """An LM decoder projection's weight: attention, dense MLP, or a MoE expert's stored one module each
    (`mlp.experts.{e}.gate_proj.weight`, the FP8 checkpoints' layout: tests/engine/test_fp8_experts.py)."""
    return ".layers." in name and "visual" not in name and (name.endswith(QUANTIZED) or bool(PER_EXPERT.search(name)))


def _key(name: str) -> str:
    """'3.self_attn.q_proj' from a tensor or module name, the same in any checkpoint layout."""
    return name.split(".layers.", 1)[1].removesuffix(".weight")


def _fused_key(key: str) -> str:
    layer, module = key.rsplit(".", 1)
    return f"{layer}.{FUSED.get(module, module)}"


def calibrate(src) -> dict[str, float]:
    """Per LM projection (`_key`): max|input| / 448 over the test prompts (a static input_scale)."""
    oracle = HFOracle(src)
    seen: dict[str, float] = {}

    def record(name):
        def hook(_m, args):
            seen[name] = max(seen.get(name, 0.0), float(args[0].abs().max()))
        return hook

    for name, m in oracle.model.named_modules():
        if ".layers." in name and "visual" not in name and name.endswith(MODULES):
            m.register_forward_pre_hook(record(_key(name)))
    for prompt, imgs in PROMPTS:
        oracle.generate(prompt, imgs, 2)
    # k_proj's and up_proj's scales set apart from their fused partners': the largest must be used
    return {k: v / 448 * (1.5 if k.endswith(("k_proj", "up_proj")) else 1.0) for k, v in seen.items()}


def fp8_checkpoint(src, dst, scheme: Fp8Scheme, calib: dict[str, float] | None = None, weight_dtype=torch.float32):
    """`src` rewritten as llm-compressor writes a W8A8-FP8 model (module docstring)."""
    shutil.copytree(src, dst)
    for f in dst.glob("*.safetensors"):
        tensors, out = load_file(f), {}
        for name, t in tensors.items():
            if not _is_projection(name):
                out[name] = t
                continue
            base = name[: -len(".weight")]
            w = t.float()
            per_channel = scheme.weights == "channel"
            scale = (w.abs().amax(dim=1, keepdim=True) if per_channel else w.abs().amax().reshape(1)) / 448
            scale = scale.to(weight_dtype).float()  # a bf16 weight_scale is read as its fp32 value
            out[name] = quantize_fp8(w, scale if per_channel else scale[0])
            out[base + ".weight_scale"] = scale.to(weight_dtype)
            if scheme.activations == "static":
                out[base + ".input_scale"] = torch.tensor([calib[_key(name)]], dtype=torch.float32)
        save_file(out, f, metadata={"format": "pt"})
    config = json.loads((dst / "config.json").read_text())
    acts = {"num_bits": 8, "type": "float", "symmetric": True, "strategy": "token", "dynamic": True} \
        if scheme.activations == "token" else \
        {"num_bits": 8, "type": "float", "symmetric": True, "strategy": "tensor", "dynamic": False}
    config["quantization_config"] = {
        "quant_method": "compressed-tensors", "format": "float-quantized", "quantization_status": "compressed",
        "config_groups": {"group_0": {"targets": ["Linear"], "input_activations": acts, "output_activations": None,
                                      "weights": {"num_bits": 8, "type": "float", "symmetric": True, "dynamic": False,
                                                  "strategy": scheme.weights, "group_size": None}}},
        "ignore": ["lm_head", "re:visual.*", "re:model.visual.*"], "kv_cache_scheme": None}
    (dst / "config.json").write_text(json.dumps(config))
    return dst


def oracle_for(ckpt, dst, scheme: Fp8Scheme, tp: int) -> HFOracle:
    """transformers on `ckpt`'s dequantized weights, inputs fake-quantized as the engine does (module docstring)."""
    shutil.copytree(ckpt, dst)
    for f in dst.glob("*.safetensors"):
        tensors = load_file(f)
        for name in [n for n in tensors if _is_projection(n) and tensors[n].dtype == FP8]:
            base = name[: -len(".weight")]
            tensors[name] = dequantize_fp8(tensors[name], tensors.pop(base + ".weight_scale"), torch.float32)
            tensors.pop(base + ".input_scale", None)
        save_file(tensors, f, metadata={"format": "pt"})
    config = json.loads((dst / "config.json").read_text())
    del config["quantization_config"]
    (dst / "config.json").write_text(json.dumps(config))
    oracle = HFOracle(dst)
    statics = {}
    if scheme.activations == "static":
        scales = {_key(n.removesuffix(".input_scale")): float(t) for f in ckpt.glob("*.safetensors")
                  for n, t in load_file(f).items()
                  if n.endswith(".input_scale")}
        for k, s in scales.items():
            statics[_fused_key(k)] = max(statics.get(_fused_key(k), 0.0), s)

    def hook(key, chunks):
        def fake(_m, args):
            x = args[0]
            rows = x.reshape(-1, x.shape[-1]).float()
            if statics:
                s = torch.tensor(statics[_fused_key(key)])
                fq = quantize_fp8(rows, s).float() * s
            else:
                parts = []
                for part in rows.chunk(chunks, dim=1):
                    s = dynamic_scale(part, per_token=True)
                    parts.append(quantize_fp8(part, s).float() * s)
                fq = torch.cat(parts, dim=1)
            return (fq.reshape(x.shape).to(x.dtype), *args[1:])
        return fake

    for name, m in oracle.model.named_modules():
        if ".layers." in name and "visual" not in name and name.endswith(MODULES):
            m.register_forward_pre_hook(hook(_key(name), tp if name.endswith(("o_proj", "down_proj")) else 1))
    return oracle


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("activations", ["token", "static"])
@pytest.mark.parametrize("per_channel", [True, False], ids=["channel", "tensor"])
def test_the_fp8_kernel_equals_the_dequantized_product_within_fp32_rounding(per_channel, activations, dtype):
    """Fused parts (one with a bias): out = x' · (q · s)ᵀ + b, x' the activations' fake quantization
    (per token, or per tensor with the largest of the parts' input scales). Each product of two e4m3
    values is exact in fp32, so with R = |x'| · |q · s|ᵀ the fp32 sums (any order, K terms) and the
    scaling stay within (K + 3) · 2⁻²⁴ · R of the float64 product; a bf16 output is rounded once
    more, and the bias added in bf16 once again (each ≤ 2⁻⁹ relative): 2⁻⁸ · R more."""
    gen = torch.Generator().manual_seed(per_channel * 2 + (activations == "static"))
    K = 256
    parts = [torch.randn(n, K, generator=gen).mul(0.05) for n in (48, 16, 16)]
    scales = [(p.abs().amax(1) if per_channel else p.abs().amax().reshape(1)) / 448 * (1 + i) for i, p in
              enumerate(parts)]
    qs = [quantize_fp8(p, s.reshape(-1, 1)) for p, s in zip(parts, scales)]
    biases = [torch.randn(48, generator=gen), None, None]
    x = (torch.randn(7, K, generator=gen) * 4.0 ** (torch.arange(7) % 4)[:, None]).to(dtype)  # a shared scale shows
    input_scales = [float(x.abs().max()) / 448 * f for f in (1.0, 1.5, 0.5)] if activations == "static" else None
    biases = [b if b is None else b.to(dtype) for b in biases]
    lin = Fp8Linear.prequantized(qs, scales, biases, dtype, activations, input_scales)
    assert lin.q.dtype == FP8 and lin.out_features == 80
    # fused parts of different per-tensor scales, or per-token activations, run rowwise
    assert lin.layout == "rowwise"
    out = lin(x)
    assert out.dtype == dtype
    got = out.double()
    w = torch.cat([dequantize_fp8(q, s, torch.float64) for q, s in zip(qs, scales)])
    sx = torch.tensor(max(input_scales)) if input_scales else dynamic_scale(x, per_token=True)
    xf = quantize_fp8(x, sx).double() * sx.double()
    bias = torch.cat([biases[0], torch.zeros(32)]).double()
    want = xf @ w.t() + bias
    R = xf.abs() @ w.abs().t() + bias.abs()
    bound = (K + 3) * 2.0 ** -24 * R + (2.0 ** -8 * R if dtype == torch.bfloat16 else 0)
    assert ((got - want).abs() <= bound).all(), f"max excess {((got - want).abs() - bound).max():.3g}"
    # and fp8 is not a no-op: the float weights' product is farther off than the bound
    assert ((x.double() @ torch.cat(parts).double().t() + bias - got).abs() > bound).any()


def test_one_weight_scale_and_static_activations_run_tensorwise_and_fp8_at_load_quantizes_per_tensor():
    gen = torch.Generator().manual_seed(5)
    w = torch.randn(32, 64, generator=gen) * 0.1
    s = w.abs().amax().reshape(1) / 448
    lin = Fp8Linear.prequantized([quantize_fp8(w, s[0])], [s], [None], torch.float32, "static", [0.01])
    assert lin.layout == "tensorwise" and lin.scale_b.dim() == 0
    x = torch.randn(3, 64, generator=gen)
    want = (quantize_fp8(x, torch.tensor(0.01)).double() * 0.01) @ dequantize_fp8(lin.q, s, torch.float64).t()
    assert (lin(x).double() - want).abs().max() <= 70 * 2.0 ** -24 * want.abs().max() * 64
    # --quantization fp8: one scale for the fused weights, max|w| / 448; per-token activations
    parts = [w, 3 * w[:16]]
    at_load = make_linear(parts, None, "fp8")
    assert isinstance(at_load, Fp8Linear) and at_load.layout == "rowwise"
    one = torch.cat(parts).abs().max() / 448
    torch.testing.assert_close(at_load.row_scales, one.expand(48), rtol=0, atol=0)
    assert torch.equal(at_load.q.view(torch.uint8), quantize_fp8(torch.cat(parts), one).view(torch.uint8))


# Qwen2.5-VL's language model is Qwen2-VL's; each rank's slices at TP2 in either scheme: the read_layer test
CASES = [("qwen3_vl", Fp8Scheme("tensor", "static"), 1), ("qwen2_vl", Fp8Scheme("channel", "token"), 2)]


@pytest.mark.parametrize("arch, scheme, tp", CASES, ids=[f"{a}-{s.weights}-{s.activations}-tp{t}" for a, s, t in CASES])
def test_a_compressed_tensors_checkpoint_equals_transformers_on_its_dequantized_weights(request, tmp_path, arch,
                                                                                        scheme, tp):
    src = request.getfixturevalue(f"{arch}_tiny")
    calib = calibrate(src) if scheme.activations == "static" else None
    ckpt = fp8_checkpoint(src, tmp_path / "fp8", scheme, calib)
    assert read_fp8_scheme(ckpt) == scheme
    oracle = oracle_for(ckpt, tmp_path / "oracle", scheme, tp)
    llm = LLM(str(ckpt), device="cpu", dtype="float32", tensor_parallel_size=tp, kv_cache_bytes=16 << 20)
    try:
        assert llm.engine.model.quantization == "compressed-tensors"
        assert llm.engine.kv_layout().quantization == "compressed-tensors"
        if tp == 1:
            layer = llm.engine.model.lm.layers[0]
            assert all(isinstance(getattr(layer, n), Fp8Linear) for n in ("qkv", "o", "gate_up", "down"))
        check_generates_oracle(llm, oracle, f"{arch} TP{tp} {scheme}")
    finally:
        llm.engine.close()


def check_generates_oracle(llm, oracle: HFOracle, what: str) -> None:
    """`llm`'s greedy tokens for `PROMPTS` equal `oracle`'s but at a near tie (`FP8_NEAR_TIE`,
    reported), each agreed token's logprob within `LOGPROB_TOL` of transformers'."""
    inputs = [{"prompt": p, "multi_modal_data": {"image": imgs}} if imgs else p for p, imgs in PROMPTS]
    outs = llm.generate(inputs, SamplingParams(max_tokens=TOKENS, ignore_eos=True, logprobs=0))
    for (prompt, imgs), out in zip(PROMPTS, outs):
        label = f"{what} {prompt[:20]!r}"
        got = list(out.outputs[0].token_ids)
        want, margins, ref = oracle_greedy(oracle, prompt, imgs)
        assert_same_greedy(got, want, margins, label, FP8_NEAR_TIE)
        for i, (g, w) in enumerate(zip(got, want)):
            if g != w:
                break
            lp = out.outputs[0].logprobs[i].logprob
            print(f"{label}: token {i} logprob differs by {abs(lp - ref[i]):.2g}")
            assert abs(lp - ref[i]) <= LOGPROB_TOL, f"{label}: token {i} logprob {lp} vs transformers' {ref[i]}"


def oracle_greedy(oracle: HFOracle, prompt, imgs) -> tuple[list[int], list[float], list[float]]:
    """transformers' greedy tokens, each position's top-2 logit gap and its token's log-softmax."""
    inputs = oracle.inputs(prompt, imgs)
    out = oracle.model.generate(**inputs, max_new_tokens=TOKENS, do_sample=False, eos_token_id=None,
                                pad_token_id=oracle.tokenizer.pad_token_id or 0, output_logits=True,
                                return_dict_in_generate=True)
    tokens = out.sequences[0, inputs["input_ids"].shape[1]:].tolist()
    logits = [step[0].double() for step in out.logits]
    margins = [float(d[0] - d[1]) for d in (lg.topk(2).values for lg in logits)]
    return tokens, margins, [float(torch.log_softmax(lg, -1)[t]) for lg, t in zip(logits, tokens)]


@pytest.mark.parametrize("scheme", [Fp8Scheme("channel", "token"), Fp8Scheme("tensor", "static")],
                         ids=["channel-token", "tensor-static"])
def test_each_rank_reads_its_slices_of_the_fp8_weights_and_their_scales(qwen2_vl_tiny, tmp_path, scheme):
    """Split by outputs (q/k/v, gate/up): the rank's rows and, per channel, their scales; split by inputs
    (o, down): the rank's input columns and every scale; a per-tensor scale and input_scale whole."""
    from transformers import AutoConfig

    from epdserve.engine.lm.shard_loader import SafetensorsReader, layer_prefix, read_layer
    from epdserve.engine.tp.shard import TPShard

    calib = {f"{i}.{m}": 0.01 * (1.5 if m.endswith("k_proj") else 1.0) for i in range(8) for m in MODULES}
    ckpt = fp8_checkpoint(qwen2_vl_tiny, tmp_path / "fp8", scheme, calib)
    text = AutoConfig.from_pretrained(ckpt).get_text_config()
    reader = SafetensorsReader(ckpt)
    p = layer_prefix(reader, 0)
    whole = {m: (reader.get(p + m + ".weight"), reader.get(p + m + ".weight_scale").float().reshape(-1))
             for m in MODULES}
    half_q, half_mlp = text.hidden_size // 2, text.intermediate_size // 2
    for rank in range(2):
        layer = read_layer(reader, 0, text, TPShard(rank, 2), torch.float32, "cpu", fp8=scheme)
        q, s = whole["self_attn.q_proj"]
        rows = slice(rank * half_q, (rank + 1) * half_q)
        assert torch.equal(layer.qkv.q[:half_q].view(torch.uint8), q[rows].view(torch.uint8))
        want = s[rows] if scheme.weights == "channel" else s.expand(half_q)
        assert torch.equal(layer.qkv.row_scales[:half_q], want)
        d, s = whole["mlp.down_proj"]
        cols = slice(rank * half_mlp, (rank + 1) * half_mlp)
        assert torch.equal(layer.down.q.view(torch.uint8), d[:, cols].contiguous().view(torch.uint8))
        assert torch.equal(layer.down.row_scales, s.expand(d.shape[0]))
        if scheme.activations == "static":  # the fused projection's largest input scale, the same on every rank
            assert float(layer.qkv.input_scale) == pytest.approx(0.015, rel=1e-6)
            assert float(layer.down.input_scale) == pytest.approx(0.01, rel=1e-6)


def test_what_cannot_run_as_fp8_is_refused_at_start_up_naming_why(qwen2_vl_tiny, tmp_path):
    from transformers import AutoConfig

    from epdserve.engine.lm.shard_loader import SafetensorsReader, read_layer
    from epdserve.engine.tp.shard import TPShard

    # a method the platform lacks: no FP8 kernel on the NPU; a CUDA device below 8.9
    assert check_method("compressed-tensors", "cuda") == "compressed-tensors" and check_method("fp8", "cpu") == "fp8"
    with pytest.raises(ValueError, match="quantization=fp8 runs on cpu, cuda only .* not on npu"):
        check_method("fp8", "npu")
    why = fp8_capability_refusal("NVIDIA A100-SXM4-80GB", (8, 0))
    assert "compute capability >= 8.9" in why and "has 8.0" in why and "Serve" in why
    assert fp8_capability_refusal("NVIDIA L4", (8, 9)) is None and fp8_capability_refusal("H100", (9, 0)) is None
    check_fp8_device("cpu", {"rowwise", "tensorwise"}, torch.float32)  # this CPU's torch runs both layouts
    with pytest.raises(ValueError, match="FP8 projections run on CPU and CUDA only"):
        check_fp8_device("meta", {"rowwise"}, torch.float32)

    scheme = Fp8Scheme("channel", "static")
    calib = {f"{i}.{m}": 0.01 for i in range(8) for m in MODULES}
    ckpt = fp8_checkpoint(qwen2_vl_tiny, tmp_path / "fp8", scheme, calib)
    with pytest.raises(ValueError, match="holds its language model in FP8 already .* --quantization w8a8 cannot"):
        LLM(str(ckpt), device="cpu", quantization="w8a8")
    with pytest.raises(ValueError, match="--quantization compressed-tensors runs an FP8 checkpoint's own weights"):
        LLM(str(qwen2_vl_tiny), device="cpu", quantization="compressed-tensors")

    config = json.loads((ckpt / "config.json").read_text())
    qc = config["quantization_config"]
    w = qc["config_groups"]["group_0"]["weights"]
    for change, message in (
            ({"quant_method": "fp8"}, r"'fp8' without weight_block_size \(per-tensor\) is not supported yet"),
            ({"quant_method": "fp8", "weight_block_size": [128, 128], "activation_scheme": "static"},
             "activation_scheme 'dynamic' only"),
            ({"config_groups": {"g": {"weights": {**w, "strategy": "block", "block_structure": [128, 128]},
                                      "input_activations": {"num_bits": 8, "type": "float", "dynamic": True,
                                                            "strategy": "group"}}}},
             "compressed-tensors block-wise FP8"),
            ({"format": "int-quantized"}, "format 'int-quantized'"),
            ({"format": "mixed-precision", "config_groups": {"g": {**qc["config_groups"]["group_0"],
                                                                   "format": "pack-quantized"}}}, "'pack-quantized'"),
            ({"config_groups": {"g": {"weights": {**w, "num_bits": 4, "type": "int"}}}}, "weights of 4 bits"),
            ({"config_groups": {"g": {"weights": w}}}, "weight-only FP8"),
            ({"kv_cache_scheme": {"num_bits": 8, "type": "float"}}, "kv_cache_scheme"),
            ({"quant_method": "awq"}, "quant_method 'awq' is not supported")):
        (ckpt / "config.json").write_text(json.dumps({**config, "quantization_config": {**qc, **change}}))
        with pytest.raises(ValueError, match=message):
            LLM(str(ckpt), device="cpu")
    # what does run: a group's own format under a "mixed-precision" config; dynamic "tensor" activations run
    # per token (as vLLM runs them)
    group = qc["config_groups"]["group_0"]
    for change, want in (({"format": "mixed-precision", "config_groups": {"g": {**group, "format": "float-quantized"}}},
                          scheme),
                         ({"config_groups": {"g": {**group, "input_activations": {
                             **group["input_activations"], "dynamic": True}}}}, Fp8Scheme("channel", "token"))):
        (ckpt / "config.json").write_text(json.dumps({**config, "quantization_config": {**qc, **change}}))
        assert read_fp8_scheme(ckpt) == want
    (ckpt / "config.json").write_text(json.dumps(config))

    # malformed scale tensors, named
    f = next(ckpt.glob("*.safetensors"))
    tensors = load_file(f)
    name = next(n for n in tensors if n.endswith("layers.0.self_attn.q_proj.weight_scale"))
    text = AutoConfig.from_pretrained(ckpt).get_text_config()
    for bad, message in ((tensors[name][:-1].contiguous(), r"weight_scale has shape \[\d+, 1\]; a per-channel"),
                         (torch.zeros_like(tensors[name]), "weight_scale holds a scale that is not finite and > 0"),
                         (None, "FP8 weight without its weight_scale")):
        changed = {k: v for k, v in tensors.items() if k != name}
        if bad is not None:
            changed[name] = bad
        save_file(changed, f, metadata={"format": "pt"})
        with pytest.raises(ValueError, match=message):
            read_layer(SafetensorsReader(ckpt), 0, text, TPShard(0, 1), torch.float32, "cpu", fp8=scheme)
    x_scale = name.replace("weight_scale", "input_scale")
    save_file({**tensors, x_scale: torch.tensor([0.01, 0.02])}, f, metadata={"format": "pt"})
    with pytest.raises(ValueError, match="static FP8 activations need one input_scale value"):
        LLM(str(ckpt), device="cpu", dtype="float32")  # a start-up error, through the engine's own load
    # an FP8 tensor outside the decoder projections (the LM head here)
    head = next(n for n in tensors if n.endswith("lm_head.weight") or n.endswith("embed_tokens.weight"))
    save_file({**tensors, head: tensors[head].to(FP8)}, f, metadata={"format": "pt"})
    with pytest.raises(ValueError, match=f"{head} is FP8; epdserve runs FP8 only in the language model's"):
        LLM(str(ckpt), device="cpu", dtype="float32")


def test_quantization_fp8_at_load_equals_transformers_on_its_dequantized_weights(qwen2_vl_tiny, tmp_path):
    """`--quantization fp8` on a float checkpoint: each fused projection (QKV, gate-up, o, down)
    quantized with one scale, max|w| / 448 over its parts; activations per token. The oracle and the
    bounds as for the checkpoints above."""
    dst = tmp_path / "oracle"
    shutil.copytree(qwen2_vl_tiny, dst)
    for f in dst.glob("*.safetensors"):
        tensors = load_file(f)
        names = [n for n in tensors if _is_projection(n)]
        amax: dict[str, float] = {}
        for n in names:
            k = _fused_key(_key(n))
            amax[k] = max(amax.get(k, 0.0), float(tensors[n].float().abs().max()))
        for n in names:
            scale = torch.tensor(amax[_fused_key(_key(n))], dtype=torch.float32) / 448
            tensors[n] = dequantize_fp8(quantize_fp8(tensors[n], scale), scale.reshape(1), torch.float32)
        save_file(tensors, f, metadata={"format": "pt"})
    oracle = HFOracle(dst)

    def per_token(_m, args):
        rows = args[0].reshape(-1, args[0].shape[-1]).float()
        s = dynamic_scale(rows, per_token=True)
        return ((quantize_fp8(rows, s).float() * s).reshape(args[0].shape).to(args[0].dtype), *args[1:])

    for name, m in oracle.model.named_modules():
        if ".layers." in name and "visual" not in name and name.endswith(MODULES):
            m.register_forward_pre_hook(per_token)
    llm = LLM(str(qwen2_vl_tiny), device="cpu", dtype="float32", quantization="fp8", kv_cache_bytes=16 << 20)
    try:
        assert llm.engine.model.quantization == "fp8" and isinstance(llm.engine.model.lm.layers[0].qkv, Fp8Linear)
        check_generates_oracle(llm, oracle, "--quantization fp8")
    finally:
        llm.engine.close()
