"""msModelSlim checkpoints with static W8A8 and W8A16 projections (engine/lm/static_w8a8.py,
engine/lm/prequantized.py), written here from the tiny Qwen2-VL as the format document says
(MindStudio-ModelSlim `quantized_weight_format.md`): for static W8A8, int8 weights per output
channel, the input's scale and offset calibrated from transformers' own activations on the test
prompts (asymmetric: a range widened below its min, onto -128..127), deq_scale = input_scale * weight_scale (float32),
quant_bias = round(bias / deq_scale) - input_offset * the weight's row sums (int32), the float
`.bias` left in the file as msModelSlim leaves it (the kernel must not add it again).

The oracle: transformers on a checkpoint holding the dequantized weights and round(bias /
deq_scale) * deq_scale, each quantized projection's input fake-quantized per tensor with its own
scale and offset by a forward pre-hook. Per-tensor scales are the same on every rank, so TP2's
oracle is TP1's. Bound: the engine sums int8 products exactly and applies deq_scale once; the
oracle sums float products, so logits differ by fp32 rounding, and an activation may land across a
rounding step where fp32 sums in another order (as for w8a8): outputs may part only where
transformers' top two logits are within 0.05, reported."""
from __future__ import annotations

import json
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from epdserve import LLM, SamplingParams
from epdserve.engine.lm.prequantized import DESCRIPTION
from epdserve.engine.lm.quant_linear import Int8DynamicLinear, Int8Linear, quantize_int8, quantize_rows
from epdserve.engine.lm.static_w8a8 import StaticPart, StaticW8A8Linear, quantize_per_tensor
from tests.engine.test_quantization import PROMPTS, QUANTIZED, W8A8_NEAR_TIE, dequantized_checkpoint
from tests.hf_oracle import HFOracle, assert_same_greedy

TOKENS = 8
MODULES = tuple(n.rsplit(".", 1)[0] for n in QUANTIZED)  # self_attn.q_proj, ..., mlp.down_proj


def _key(name: str) -> str:
    """A projection's name from its layer on ('3.self_attn.q_proj'), the same in transformers' module
    tree and in either checkpoint layout ('model.layers.3...' or 'model.language_model.layers.3...')."""
    return name.split(".layers.", 1)[1].removesuffix(".weight")


def _lm_projections(model):
    return {_key(name): m for name, m in model.named_modules()
            if ".layers." in name and "visual" not in name and name.endswith(MODULES)}


def calibrate(src) -> dict[str, tuple[float, int]]:
    """(input_scale, input_offset) per LM projection (`_key`): the min..max of its inputs over the
    test prompts, widened below by half its span (so every offset is far from zero and a wrong sign
    or a double-counted quant_bias shows), mapped onto -128..127."""
    oracle = HFOracle(src)
    seen: dict[str, list[float]] = {}

    def record(name):
        def hook(_m, args):
            lo, hi = seen.setdefault(name, [0.0, 0.0])
            seen[name] = [min(lo, float(args[0].min())), max(hi, float(args[0].max()))]
        return hook

    for name, m in _lm_projections(oracle.model).items():
        m.register_forward_pre_hook(record(name))
    for prompt, imgs in PROMPTS:
        oracle.generate(prompt, imgs, 2)
    out = {}
    for name, (lo, hi) in seen.items():
        lo -= (hi - lo) / 2
        scale = (hi - lo) / 255.0
        out[name] = (scale, int(max(-128, min(127, round(-128 - lo / scale)))))
    return out


def static_checkpoint(src, dst, calib, dynamic_down: bool = False):
    """`src` rewritten as msModelSlim writes a static W8A8 model (see the module docstring); with
    `dynamic_down` the down projections are W8A8_DYNAMIC instead (a mixed checkpoint)."""
    shutil.copytree(src, dst)
    desc = {"model_quant_type": "W8A8"}
    for f in dst.glob("*.safetensors"):
        tensors, out = load_file(f), {}
        for name, t in tensors.items():
            out[name], desc[name] = t, "FLOAT"
        for name, w in tensors.items():
            if not (".layers." in name and "visual" not in name and name.endswith(QUANTIZED)):
                continue
            base = name[: -len(".weight")]
            q, ws = quantize_int8(w.float())
            if dynamic_down and name.endswith("down_proj.weight"):
                out[name], out[base + ".weight_scale"] = q, ws.reshape(-1, 1)
                out[base + ".weight_offset"] = torch.zeros_like(ws.reshape(-1, 1))
                desc[name] = "W8A8_DYNAMIC"
                continue
            scale, offset = calib[_key(name)]
            deq = (torch.tensor(scale, dtype=torch.float32) * ws.float()).float()
            bias = tensors.get(base + ".bias")
            folded = torch.round(bias.float() / deq).to(torch.int32) if bias is not None else 0
            out[name] = q
            out[base + ".input_scale"] = torch.tensor([scale], dtype=torch.float32)
            out[base + ".input_offset"] = torch.tensor([float(offset)], dtype=torch.float32)
            out[base + ".deq_scale"] = deq
            out[base + ".quant_bias"] = (folded - offset * q.to(torch.int32).sum(1)).to(torch.int32)
            for k in ("weight", "input_scale", "input_offset", "deq_scale", "quant_bias"):
                desc[f"{base}.{k}"] = "W8A8"
        save_file(out, f, metadata={"format": "pt"})
    (dst / DESCRIPTION).write_text(json.dumps(desc))
    return dst


def oracle_for(src, dst, calib, dynamic_down: bool = False) -> HFOracle:
    """transformers on the weights the engine computes with (module docstring), inputs fake-quantized:
    the dequantized weights as tests/engine/test_quantization.py writes them, then each static
    projection's bias rounded to its deq_scale grid (the part quant_bias carries)."""
    dequantized_checkpoint(src, dst)
    for f in dst.glob("*.safetensors"):
        tensors = load_file(f)
        for name, w in load_file(src / f.name).items():
            base = name[: -len(".weight")]
            if (".layers." in name and "visual" not in name and name.endswith(QUANTIZED) and base + ".bias" in tensors
                    and not (dynamic_down and name.endswith("down_proj.weight"))):
                deq = torch.tensor(calib[_key(name)][0], dtype=torch.float32) * quantize_int8(w.float())[1].float()
                tensors[base + ".bias"] = torch.round(tensors[base + ".bias"].float() / deq) * deq
        save_file(tensors, f, metadata={"format": "pt"})
    oracle = HFOracle(dst)

    def per_tensor(scale, offset):
        def fake(_m, args):
            x = args[0]
            xq = quantize_per_tensor(x.reshape(-1, x.shape[-1]), scale, offset)  # the format's rounding (checked: the kernel test)
            return (((xq.float() - offset) * scale).reshape(x.shape).to(x.dtype), *args[1:])
        return fake

    def per_token(_m, args):
        x = args[0]
        xq, sx = quantize_rows(x.reshape(-1, x.shape[-1]))
        return ((xq.float() * sx).reshape(x.shape).to(x.dtype), *args[1:])

    for name, m in _lm_projections(oracle.model).items():
        dynamic = dynamic_down and name.endswith("down_proj")
        m.register_forward_pre_hook(per_token if dynamic else per_tensor(*calib[name]))
    return oracle


@pytest.fixture(scope="module")
def calib(qwen2_vl_tiny):
    return calibrate(qwen2_vl_tiny)


def test_the_static_kernel_equals_the_format_arithmetic_within_rounding():
    """Two parts calibrated differently (two GEMMs), one without quant_bias (a rank > 0 of a
    projection split by its inputs): each output is (round(x / s + o) @ W^T + quant_bias) * deq."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(5, 64, generator=g)
    parts = []
    for i, (scale, offset, bias) in enumerate([(0.02, 3, True), (0.03, -5, True), (0.03, -5, False)]):
        q = torch.randint(-127, 128, (8 + i, 64), generator=g, dtype=torch.int8)
        qb = torch.randint(-1000, 1000, (8 + i,), generator=g, dtype=torch.int32) if bias else None
        parts.append(StaticPart(q, scale, offset, torch.rand(8 + i, generator=g) * 1e-3, qb))
    lin = StaticW8A8Linear(parts)
    assert len(lin.groups) == 2 and lin.out_features == 8 + 9 + 10
    got = lin(x)
    want = []
    for p in parts:
        xq = torch.round(x.double() / p.input_scale + p.input_offset).clamp(-128, 127)
        acc = xq @ p.q.double().t() + (p.quant_bias.double() if p.quant_bias is not None else 0)
        want.append(acc * p.deq_scale.double())
    want = torch.cat(want, dim=1)
    # int32 sums are exact; the rest is one fp32 multiply (and the reciprocal's rounding may move an
    # activation exactly at a half step: none here)
    torch.testing.assert_close(got.double(), want, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("tp, mixed", [(1, True), (2, False)], ids=["tp1-mixed", "tp2-static"])
def test_greedy_outputs_equal_transformers_fake_quantized_per_tensor(qwen2_vl_tiny, calib, tmp_path, tp, mixed):
    ckpt = static_checkpoint(qwen2_vl_tiny, tmp_path / "ms", calib, dynamic_down=mixed)
    oracle = oracle_for(qwen2_vl_tiny, tmp_path / "oracle", calib, dynamic_down=mixed)
    llm = LLM(str(ckpt), device="cpu", dtype="float32", tensor_parallel_size=tp, kv_cache_bytes=16 << 20)
    try:
        assert llm.engine.model.quantization == ("ascend" if mixed else "w8a8-static")
        assert llm.engine.kv_layout().quantization == llm.engine.model.quantization  # registration compares it
        if tp == 1:
            from types import SimpleNamespace

            from epdserve.instance.host import InstanceHost

            layer = llm.engine.model.lm.layers[0]
            assert isinstance(layer.qkv, StaticW8A8Linear) and isinstance(layer.down, Int8DynamicLinear)
            # the ready line's lm-weights= names each projection's method
            assert InstanceHost.weights_method(SimpleNamespace(model=llm.engine.model)) == \
                "ascend(qkv:w8a8-static,o:w8a8-static,gate_up:w8a8-static,down:w8a8)"
        inputs = [{"prompt": p, "multi_modal_data": {"image": imgs}} if imgs else p for p, imgs in PROMPTS]
        outs = llm.generate(inputs, SamplingParams(max_tokens=TOKENS, ignore_eos=True))
        for (prompt, imgs), out in zip(PROMPTS, outs):
            want, margins = oracle.generate_with_margins(prompt, imgs, TOKENS)
            assert_same_greedy(out.outputs[0].token_ids, want, margins, f"static W8A8 TP{tp} {prompt[:20]!r}",
                               W8A8_NEAR_TIE)
    finally:
        llm.engine.close()


def test_a_w8a16_checkpoint_runs_as_int8_token_for_token(qwen2_vl_tiny, tmp_path):
    from tests.engine.test_prequantized import _greedy, modelslim_checkpoint

    w8a16 = modelslim_checkpoint(qwen2_vl_tiny, tmp_path / "w8a16", kind="W8A16")
    got, method = _greedy(w8a16)
    want, _ = _greedy(qwen2_vl_tiny, quantization="int8")
    assert method == "int8" and got == want


def test_what_the_static_loader_cannot_read_is_refused_naming_why(qwen2_vl_tiny, calib, tmp_path):
    from tests.engine.test_prequantized import modelslim_checkpoint

    with pytest.raises(ValueError, match="--quantization ascend runs an msModelSlim checkpoint's own"):
        LLM(model=str(qwen2_vl_tiny), device="cpu", quantization="ascend")
    skewed = modelslim_checkpoint(qwen2_vl_tiny, tmp_path / "skewed", kind="W8A16", offset=2.0)
    with pytest.raises(ValueError, match="asymmetric W8A16 weights are not supported"):
        LLM(model=str(skewed), device="cpu")
    ckpt = static_checkpoint(qwen2_vl_tiny, tmp_path / "ms", calib)
    f = next(ckpt.glob("*.safetensors"))
    tensors = load_file(f)
    name = next(n for n in tensors if n.endswith("q_proj.deq_scale"))
    for bad, message in ((tensors[name].view(torch.int32).to(torch.int64), "int64 encoding .* is not"),
                         (tensors[name][:-1].contiguous(), "one value per output row")):
        save_file({**tensors, name: bad}, f, metadata={"format": "pt"})
        with pytest.raises(ValueError, match=message):
            LLM(model=str(ckpt), device="cpu", dtype="float32")
    scale = name.replace("deq_scale", "input_scale")
    save_file({**tensors, scale: torch.tensor([0.0])}, f, metadata={"format": "pt"})
    with pytest.raises(ValueError, match="the scale > 0"):
        LLM(model=str(ckpt), device="cpu", dtype="float32")


def test_the_quantized_projections_are_the_methods_the_description_names(qwen2_vl_tiny, calib, tmp_path):
    """A mixed checkpoint holds each projection by its own type: static W8A8 and W8A8_DYNAMIC."""
    from transformers import AutoConfig

    from epdserve.engine.lm.shard_loader import SafetensorsReader, read_layer
    from epdserve.engine.tp.shard import TPShard

    ckpt = static_checkpoint(qwen2_vl_tiny, tmp_path / "mixed", calib, dynamic_down=True)
    desc = json.loads((ckpt / DESCRIPTION).read_text())
    text = AutoConfig.from_pretrained(ckpt).get_text_config()
    for rank in range(2):
        layer = read_layer(SafetensorsReader(ckpt), 0, text, TPShard(rank, 2), torch.float32, "cpu", description=desc)
        assert isinstance(layer.qkv, StaticW8A8Linear) and isinstance(layer.down, Int8DynamicLinear)
        assert (layer.o.groups[0].bias is not None) == (rank == 0)  # split by inputs: rank 0 adds quant_bias
        assert layer.qkv.groups[0].bias is not None  # split by outputs: every rank its rows' quant_bias
    assert not isinstance(layer.gate_up, Int8Linear)
