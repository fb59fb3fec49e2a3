"""Checkpoints whose LM linears msModelSlim quantized already (W8A8_DYNAMIC: int8 weights, a scale
per output channel, zero offsets, `quant_model_description.json`; engine/lm/prequantized.py), on
the tiny Qwen2-VL: the checkpoint is written here in that format from the demo's weights, quantized
the way `--quantization w8a8` quantizes at load, so the two must compute the very same thing —
greedy tokens equal, token for token, with an image (and `--quantization w8a8` itself equals
transformers on the dequantized weights: tests/engine/test_quantization.py). Each TP rank reads its
own slices: the rows of q/k/v and gate/up with their scales, the input columns of o and down with
every scale. Types epdserve does not run, asymmetric weights and a clashing --quantization are
refused, naming why."""
from __future__ import annotations

import json
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from epdserve import LLM, SamplingParams
from epdserve.engine.lm.prequantized import DESCRIPTION
from epdserve.engine.lm.quant_linear import quantize_int8
from epdserve.engine.lm.shard_loader import SafetensorsReader, layer_prefix, read_layer
from epdserve.engine.tp.shard import TPShard
from tests.engine.test_quantization import PROMPTS, QUANTIZED


def modelslim_checkpoint(src, dst, kind="W8A8_DYNAMIC", offset=0.0):
    """`src` rewritten as msModelSlim writes a W8A8_DYNAMIC model: each LM projection's weight int8
    [out, in], weight_scale and weight_offset [out, 1]; the description names every tensor."""
    shutil.copytree(src, dst)
    desc = {"model_quant_type": kind}
    for f in dst.glob("*.safetensors"):
        tensors, out = load_file(f), {}
        for name, t in tensors.items():
            if ".layers." in name and "visual" not in name and name.endswith(QUANTIZED):
                q, scales = quantize_int8(t)
                base = name[: -len(".weight")]
                out[name], out[base + ".weight_scale"] = q, scales.reshape(-1, 1)
                out[base + ".weight_offset"] = torch.full_like(scales.reshape(-1, 1), offset)
                desc[name] = kind
            else:
                out[name] = t
                desc[name] = "FLOAT"
        save_file(out, f, metadata={"format": "pt"})
    (dst / DESCRIPTION).write_text(json.dumps(desc))
    return dst


@pytest.fixture(scope="module")
def modelslim(qwen2_vl_tiny, tmp_path_factory):
    return modelslim_checkpoint(qwen2_vl_tiny, tmp_path_factory.mktemp("ms") / "w8a8-dynamic")


def _greedy(model, **kw):
    llm = LLM(str(model), device="cpu", dtype="float32", kv_cache_bytes=8 << 20, **kw)
    try:
        inputs = [{"prompt": p, "multi_modal_data": {"image": imgs}} if imgs else p for p, imgs in PROMPTS]
        outs = llm.generate(inputs, SamplingParams(max_tokens=10, ignore_eos=True))
        return [list(o.outputs[0].token_ids) for o in outs], llm.engine.model.quantization
    finally:
        llm.engine.close()


def test_a_modelslim_w8a8_dynamic_checkpoint_runs_as_w8a8_token_for_token(qwen2_vl_tiny, modelslim):
    got, method = _greedy(modelslim)
    want, _ = _greedy(qwen2_vl_tiny, quantization="w8a8")
    assert method == "w8a8" and got == want


def test_each_rank_reads_its_slices_of_the_int8_weights_and_their_scales(modelslim):
    from transformers import AutoConfig

    text = AutoConfig.from_pretrained(modelslim).get_text_config()
    reader = SafetensorsReader(modelslim)
    p = layer_prefix(reader, 0)
    desc = json.loads((modelslim / DESCRIPTION).read_text())
    whole = {n: reader.get(p + n) for n in ("self_attn.q_proj.weight", "self_attn.o_proj.weight",
                                             "self_attn.o_proj.weight_scale", "mlp.down_proj.weight",
                                             "mlp.down_proj.weight_scale", "mlp.gate_proj.weight_scale")}
    d = text.hidden_size // text.num_attention_heads
    for rank in range(2):
        layer = read_layer(reader, 0, text, TPShard(rank, 2), torch.float32, "cpu", description=desc)
        half_q, half_mlp = text.num_attention_heads // 2 * d, text.intermediate_size // 2
        qs, qe = rank * half_q, (rank + 1) * half_q
        assert torch.equal(layer.qkv.q[:half_q], whole["self_attn.q_proj.weight"][qs:qe])
        assert torch.equal(layer.o.q, whole["self_attn.o_proj.weight"][:, qs:qe])  # its input columns, every row
        assert torch.equal(layer.o.scales, whole["self_attn.o_proj.weight_scale"].reshape(-1))  # every scale
        ms, me = rank * half_mlp, (rank + 1) * half_mlp
        assert torch.equal(layer.down.q, whole["mlp.down_proj.weight"][:, ms:me])
        assert torch.equal(layer.down.scales, whole["mlp.down_proj.weight_scale"].reshape(-1))
        assert torch.equal(layer.gate_up.scales[:half_mlp], whole["mlp.gate_proj.weight_scale"].reshape(-1)[ms:me])


def test_what_epdserve_cannot_run_is_refused_naming_why(qwen2_vl_tiny, modelslim, tmp_path):
    w4a8 = modelslim_checkpoint(qwen2_vl_tiny, tmp_path / "w4a8", kind="W4A8_DYNAMIC")
    with pytest.raises(ValueError, match="quantizes projections as W4A8_DYNAMIC; epdserve runs msModelSlim's "
                                         "W8A8_DYNAMIC, W8A16, W8A8 only"):
        LLM(model=str(w4a8), device="cpu")
    with pytest.raises(ValueError, match="quantized already .* --quantization int8 cannot re-quantize it"):
        LLM(model=str(modelslim), device="cpu", quantization="int8")
    skewed = modelslim_checkpoint(qwen2_vl_tiny, tmp_path / "skewed", offset=3.0)
    with pytest.raises(ValueError, match="weight_offset is not zero: asymmetric int8 weights are not supported"):
        LLM(model=str(skewed), device="cpu")
