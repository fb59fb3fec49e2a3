"""Sharded loading (engine/lm/shard_loader.py, issue 47 item 5): every tensor a rank reads from the
checkpoint's files is its own slice, never a whole projection it then cuts; the slices of all
ranks put together are the checkpoint's tensors; transformers builds no decoder layer."""
from __future__ import annotations

import pytest
import torch
from transformers import AutoConfig

from epdserve.engine.tp.shard import TPShard
from epdserve.engine.lm import shard_loader
from epdserve.engine.lm.shard_loader import SafetensorsReader, layer_prefix, read_layers
from epdserve.model.loader import load_checkpoint

PROJ = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def _share(name: str, tp: int, kv_heads: int) -> float:  # experts: 1 / tp, as the projections
    """The part of tensor `name` one rank of `tp` holds."""
    if "norm" in name or name.endswith("mlp.gate.weight"):  # norms, a sparse layer's router: whole
        return 1.0
    if "k_proj" in name or "v_proj" in name:
        return max(kv_heads // tp, 1) / kv_heads  # past kv_heads ranks: one head each, replicated
    if "o_proj.bias" in name:
        return 1.0  # rank 0's alone
    return 1 / tp


@pytest.mark.parametrize("arch, tp", [("qwen2_5_vl", 1), ("qwen2_5_vl", 2), ("qwen2_5_vl", 4), ("qwen3_vl_moe", 2)])
def test_each_rank_reads_only_its_own_slices(request, monkeypatch, arch, tp):
    model = request.getfixturevalue(f"{arch}_tiny")
    tc = AutoConfig.from_pretrained(model).text_config
    whole = SafetensorsReader(model)
    reads: list[tuple[str, torch.Tensor]] = []
    real_get = SafetensorsReader.get

    def counted(self, name, rows=None, cols=None):
        t = real_get(self, name, rows, cols)
        reads.append((name, t))
        return t

    monkeypatch.setattr(shard_loader.SafetensorsReader, "get", counted)
    parts: dict[str, list[torch.Tensor]] = {}
    for rank in range(tp):
        reads.clear()
        read_layers(model, tc, TPShard(rank, tp), torch.float32, "cpu")
        assert reads, "nothing read"
        for name, t in list(reads):
            full = real_get(whole, name)  # not counted
            share = _share(name, tp, tc.num_key_value_heads)
            assert t.numel() == full.numel() * share, (
                f"rank {rank} of {tp} read {tuple(t.shape)} of {name} {tuple(full.shape)}: not its {share:g}")
            parts.setdefault(name, []).append(t)
    p0 = layer_prefix(whole, 0)
    sparse = bool(getattr(tc, "num_experts", 0))
    names = PROJ[:4] + (("experts.gate_up_proj", "experts.down_proj") if sparse else PROJ[4:])
    for n in names:  # the ranks' slices, put together, are the checkpoint's tensors
        mlp = n.startswith("experts.") or n in ("gate_proj", "up_proj", "down_proj")
        name = p0 + ("mlp." if mlp else "self_attn.") + n + ("" if n.startswith("experts.") else ".weight")
        dim = 1 if n in ("o_proj", "down_proj") else 0
        got = torch.cat(parts[name], dim)
        if n in ("k_proj", "v_proj") and tp > tc.num_key_value_heads:  # each head held by tp/kv_heads ranks
            got = torch.cat(parts[name][:: tp // tc.num_key_value_heads], dim)
        assert torch.equal(got, whole.get(name)), name


def test_transformers_builds_no_decoder_layer(qwen2_vl_tiny):
    ckpt = load_checkpoint(qwen2_vl_tiny, without_lm_layers=True)
    lm = ckpt.model.model.language_model
    assert len(lm.layers) == 0
    assert not any(".layers." in n for n, _ in ckpt.model.named_parameters() if "visual" not in n)
    assert ckpt.model.config.text_config.num_hidden_layers == 2  # the checkpoint's count, put back

