"""Block-wise FP8 checkpoints (engine/lm/fp8_block_linear.py; Qwen's and DeepSeek's own format:
`"quant_method": "fp8"` with `weight_block_size`, each LM projection's `weight` float8_e4m3fn and
`weight_scale_inv` per block), written here from the tiny demo model with [32, 32] blocks so that it
has several. The kernel against the float product of the dequantized weights and the activations
fake-quantized per token and group of inputs; end to end against transformers on the dequantized
weights with the same fake quantization, bounds as in tests/engine/test_fp8.py; each tensor-parallel
rank's rows and whole groups of inputs; a rank's share of partial groups refused."""
from __future__ import annotations

import json
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from epdserve import LLM
from epdserve.engine.lm.fp8_checkpoint import Fp8Scheme, read_fp8_scheme
from epdserve.engine.lm.fp8_linear import dynamic_scale, quantize_fp8
from tests.engine.test_fp8 import MODULES, _is_projection, check_generates_oracle
from tests.hf_oracle import HFOracle


def block_checkpoint(src, dst, block=(32, 32)):
    """`src` rewritten as Qwen's block-wise FP8 checkpoints are: each LM projection's `weight`
    float8_e4m3fn and `weight_scale_inv` fp32 [ceil(out / bn), ceil(in / bk)], max|w| / 448 of its block."""
    from epdserve.engine.lm.fp8_block_linear import block_row_scales

    bn, bk = block
    shutil.copytree(src, dst)
    for f in dst.glob("*.safetensors"):
        tensors, out = load_file(f), {}
        for name, t in tensors.items():
            if not _is_projection(name):
                out[name] = t
                continue
            w = t.float()
            n, k = w.shape
            s = torch.zeros(-(-n // bn), -(-k // bk))
            for i in range(s.shape[0]):
                for j in range(s.shape[1]):
                    s[i, j] = w[i * bn:(i + 1) * bn, j * bk:(j + 1) * bk].abs().max() / 448
            per_row = block_row_scales(s, range(n), bn).repeat_interleave(bk, dim=1)[:, :k]
            out[name], out[name[: -len(".weight")] + ".weight_scale_inv"] = quantize_fp8(w, per_row), s
        save_file(out, f, metadata={"format": "pt"})
    config = json.loads((dst / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                                     "weight_block_size": list(block), "modules_to_not_convert": ["lm_head", "visual"]}
    (dst / "config.json").write_text(json.dumps(config))
    return dst


def test_the_block_kernel_equals_the_dequantized_product_within_fp32_rounding():
    """Block-wise: out = Σ_g x'_g · (q_g · s_g)ᵀ + b over groups g of bk inputs (the last one short),
    x'_g each token's group fake-quantized; each group's sum in fp32 then the groups' sum: within
    (K + 3 + groups) · 2⁻²⁴ · R of the float64 product."""
    from epdserve.engine.lm.fp8_block_linear import Fp8BlockLinear, block_row_scales, dequantize_fp8_blocks

    gen = torch.Generator().manual_seed(11)
    K, bn, bk = 200, 16, 64  # groups of 64, 64, 64, 8 inputs
    parts = [torch.randn(n, K, generator=gen) * 0.05 for n in (40, 24)]
    row_scales, qs = [], []
    for w in parts:
        blocks = torch.rand(-(-w.shape[0] // bn), -(-K // bk), generator=gen) * 1e-3 + 1e-4
        r = block_row_scales(blocks, range(w.shape[0]), bn)
        qs.append(quantize_fp8(w, r.repeat_interleave(bk, dim=1)[:, :K]))
        row_scales.append(r)
    bias = torch.randn(64, generator=gen)
    lin = Fp8BlockLinear(qs, row_scales, [bias[:40], bias[40:]], torch.float32, bk)
    assert lin.out_features == 64 and [b - a for a, b in lin.bounds] == [64, 64, 64, 8]
    x = torch.randn(5, K, generator=gen) * 4.0 ** (torch.arange(5) % 3)[:, None]
    got = lin(x).double()
    w = torch.cat([dequantize_fp8_blocks(q, r, bk, torch.float64) for q, r in zip(qs, row_scales)])
    xf = torch.cat([quantize_fp8(x[:, a:b], s).double() * s.double() for a, b in lin.bounds
                    for s in [dynamic_scale(x[:, a:b], per_token=True)]], dim=1)
    want = xf @ w.t() + bias.double()
    R = xf.abs() @ w.abs().t() + bias.double().abs()
    bound = (K + 3 + len(lin.bounds)) * 2.0 ** -24 * R
    assert ((got - want).abs() <= bound).all(), f"max excess {((got - want).abs() - bound).max():.3g}"
    assert torch.equal(lin.q.view(torch.uint8), torch.cat(qs).view(torch.uint8))


def test_a_block_wise_fp8_checkpoint_equals_transformers_on_its_dequantized_weights(qwen2_vl_tiny, tmp_path):
    """Qwen's block-wise format ([32, 32] blocks here, so the tiny model has several): TP1 end to end
    against transformers on the dequantized weights, each projection's input fake-quantized per token
    and group of 32; each TP2 rank's rows and its whole groups of inputs with their block scales; a
    rank's share that is not whole groups refused."""
    from transformers import AutoConfig

    from epdserve.engine.lm.fp8_block_linear import Fp8BlockLinear, block_row_scales, dequantize_fp8_blocks
    from epdserve.engine.lm.shard_loader import SafetensorsReader, layer_prefix, read_layer
    from epdserve.engine.tp.shard import TPShard

    ckpt = block_checkpoint(qwen2_vl_tiny, tmp_path / "block")
    scheme = read_fp8_scheme(ckpt)
    assert scheme == Fp8Scheme("block", "group", (32, 32)) and scheme.method == "fp8"
    text = AutoConfig.from_pretrained(ckpt).get_text_config()
    reader = SafetensorsReader(ckpt)
    p = layer_prefix(reader, 0)
    k, ks = reader.get(p + "self_attn.k_proj.weight"), reader.get(p + "self_attn.k_proj.weight_scale_inv")
    d, ds = reader.get(p + "mlp.down_proj.weight"), reader.get(p + "mlp.down_proj.weight_scale_inv")
    for rank in range(2):
        layer = read_layer(reader, 0, text, TPShard(rank, 2), torch.float32, "cpu", fp8=scheme)
        assert isinstance(layer.qkv, Fp8BlockLinear) and isinstance(layer.down, Fp8BlockLinear)
        kv = slice(rank * 16, (rank + 1) * 16)  # k_proj's 32 rows, 16 a rank: half a block of 32
        assert torch.equal(layer.qkv.q[32:48].view(torch.uint8), k[kv].view(torch.uint8))
        want = block_row_scales(ks, range(kv.start, kv.stop), 32)
        assert torch.equal(torch.stack([s[0, 32:48] for s in layer.qkv.scale_bs], dim=1), want)
        cols = slice(rank * 64, (rank + 1) * 64)  # down's 128 inputs, 64 a rank: two groups of 32
        assert torch.equal(layer.down.q.view(torch.uint8), d[:, cols].contiguous().view(torch.uint8))
        assert torch.equal(torch.stack([s[0] for s in layer.down.scale_bs], dim=1),
                           block_row_scales(ds[:, rank * 2:(rank + 1) * 2], range(d.shape[0]), 32))
    skewed = block_checkpoint(qwen2_vl_tiny, tmp_path / "skewed", block=(32, 48))
    with pytest.raises(ValueError, match="o_proj: this rank's inputs 0..32 are not whole groups of 48"):
        read_layer(SafetensorsReader(skewed), 0, text, TPShard(0, 2), torch.float32, "cpu",
                   fp8=read_fp8_scheme(skewed))

    dst = tmp_path / "oracle"
    shutil.copytree(ckpt, dst)
    for f in dst.glob("*.safetensors"):
        tensors = load_file(f)
        for name in [n for n in tensors if _is_projection(n)]:
            s = tensors.pop(name[: -len(".weight")] + ".weight_scale_inv")
            rows = block_row_scales(s, range(tensors[name].shape[0]), 32)
            tensors[name] = dequantize_fp8_blocks(tensors[name], rows, 32, torch.float32)
        save_file(tensors, f, metadata={"format": "pt"})
    config = json.loads((dst / "config.json").read_text())
    del config["quantization_config"]
    (dst / "config.json").write_text(json.dumps(config))
    oracle = HFOracle(dst)

    def per_group(_m, args):
        rows = args[0].reshape(-1, args[0].shape[-1]).float()
        groups = [quantize_fp8(g, s).float() * s for g in rows.split(32, dim=1)
                  for s in [dynamic_scale(g, per_token=True)]]
        return (torch.cat(groups, dim=1).reshape(args[0].shape).to(args[0].dtype), *args[1:])

    for name, m in oracle.model.named_modules():
        if ".layers." in name and "visual" not in name and name.endswith(MODULES):
            m.register_forward_pre_hook(per_group)
    llm = LLM(str(ckpt), device="cpu", dtype="float32", kv_cache_bytes=16 << 20)
    try:
        assert llm.engine.model.quantization == "fp8"
        check_generates_oracle(llm, oracle, "block-wise fp8")
    finally:
        llm.engine.close()
