"""`LeanLayerWeights`: one decoder layer's weights as the lean forward reads them.

Built once per process from the loaded transformers model (the checkpoint's own names:
`self_attn.{q,k,v,o}_proj`, `self_attn.{q,k}_norm` (Qwen3), `mlp.{gate,up,down}_proj`,
`input_layernorm`, `post_attention_layernorm`): q, k and v are fused into one projection and
gate and up into another (engine/lm/linear.py `Linear`, which decides how the weights are held
and applied), so a layer makes four GEMMs where transformers makes seven. A Qwen3-VL-MoE sparse
layer keeps transformers' own expert block (`moe`), called as it is, when held dense; else (and
as engine/lm/shard_loader.py reads it) an `ExpertShard` whose experts the method holds too. Once built, the transformers layers are dropped
(`drop_hf_layers`): the fused copies replace them, so the process holds one copy of the LM.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from epdserve.engine.lm.expert_linears import expert_method
from epdserve.engine.lm.experts import ExpertShard
from epdserve.engine.lm.linear import Linear, make_linear


@dataclass
class LeanLayerWeights:
    qkv: Linear  # [hidden] -> [(H + 2 KVH) * d]
    o: Linear  # [H * d] -> [hidden]
    input_norm: torch.Tensor
    post_norm: torch.Tensor
    q_norm: torch.Tensor | None  # Qwen3: RMSNorm over each head
    k_norm: torch.Tensor | None
    gate_up: Linear | None  # [hidden] -> [2 I]; None for a sparse (MoE) layer
    down: Linear | None  # [I] -> [hidden]
    moe: object | None  # transformers' sparse MoE block, or an ExpertShard (engine/lm/experts.py)

    def tensors(self) -> list[torch.Tensor]:
        """Every tensor the layer holds, the MoE block's included."""
        out = [t for t in (self.input_norm, self.post_norm, self.q_norm, self.k_norm) if t is not None]
        for lin in (self.qkv, self.o, self.gate_up, self.down):
            if lin is not None:
                out += lin.tensors()
        return out + (list(self.moe.parameters()) if self.moe is not None else [])


def _bias(lin) -> torch.Tensor | None:
    return lin.bias.detach() if lin.bias is not None else None


def layer_weights(layer: torch.nn.Module, method: str = "dense", platform: str = "cpu") -> LeanLayerWeights:
    """The lean weights of one transformers decoder layer (Qwen2-VL, Qwen2.5-VL, Qwen3-VL, Qwen3-VL-MoE),
    its projections held by `method` on `platform` (engine/lm/linear.py `linear_class`)."""
    att, mlp = layer.self_attn, layer.mlp
    q, k, v, o = att.q_proj, att.k_proj, att.v_proj, att.o_proj
    q_norm = getattr(att, "q_norm", None)
    k_norm = getattr(att, "k_norm", None)
    dense = hasattr(mlp, "gate_proj")
    return LeanLayerWeights(
        qkv=make_linear([q.weight.detach(), k.weight.detach(), v.weight.detach()], [_bias(q), _bias(k), _bias(v)],
                        method, platform),
        o=make_linear([o.weight.detach()], [_bias(o)], method, platform),
        input_norm=layer.input_layernorm.weight.detach(), post_norm=layer.post_attention_layernorm.weight.detach(),
        q_norm=q_norm.weight.detach() if q_norm is not None else None,
        k_norm=k_norm.weight.detach() if k_norm is not None else None,
        gate_up=make_linear([mlp.gate_proj.weight.detach(), mlp.up_proj.weight.detach()], method=method, platform=platform)
        if dense else None,
        down=make_linear([mlp.down_proj.weight.detach()], method=method, platform=platform) if dense else None,
        moe=None if dense else mlp if expert_method(method) == "dense" else _expert_shard(mlp, method, platform),
    )


def _expert_shard(mlp: torch.nn.Module, method: str, platform: str) -> ExpertShard:
    """Transformers' sparse MoE block as an `ExpertShard` of every expert, held by `method` on `platform`."""
    return ExpertShard(mlp.gate.weight.detach(), mlp.experts.gate_up_proj.detach(), mlp.experts.down_proj.detach(),
                       0, mlp.gate.top_k, method, platform)


def drop_hf_layers(language_model: torch.nn.Module) -> None:
    """Release transformers' own decoder layers once their weights are fused (MoE blocks stay
    referenced by the lean weights)."""
    language_model.layers = torch.nn.ModuleList()
