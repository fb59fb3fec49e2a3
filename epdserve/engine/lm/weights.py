"""`LeanLayerWeights`: one decoder layer's weights as the lean forward reads them.

Built once per process from the loaded transformers model (the checkpoint's own names:
`self_attn.{q,k,v,o}_proj`, `self_attn.{q,k}_norm` (Qwen3), `mlp.{gate,up,down}_proj`,
`input_layernorm`, `post_attention_layernorm`): q, k and v are concatenated into one projection
and gate and up into another, so a layer makes three GEMMs where transformers makes seven. A
Qwen3-VL-MoE sparse layer keeps transformers' own expert block (`moe`), called as it is.
Weights are stored transposed (`[in, out]` views of the row-major originals) so a projection is
one `mm` / `addmm` with no per-call transpose. Once built, the transformers layers are dropped
(`drop_hf_layers`): the fused copies replace them, so the process holds one copy of the LM.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class LeanLayerWeights:
    qkv_t: torch.Tensor  # [hidden, (H + 2 KVH) * d]
    qkv_bias: torch.Tensor | None
    o_t: torch.Tensor  # [H * d, hidden]
    o_bias: torch.Tensor | None
    input_norm: torch.Tensor
    post_norm: torch.Tensor
    q_norm: torch.Tensor | None  # Qwen3: RMSNorm over each head
    k_norm: torch.Tensor | None
    gate_up_t: torch.Tensor | None  # [hidden, 2 I]; None for a sparse (MoE) layer
    down_t: torch.Tensor | None  # [I, hidden]
    moe: torch.nn.Module | None  # transformers' sparse MoE block (Qwen3-VL-MoE)


def _t(w: torch.Tensor) -> torch.Tensor:
    return w.detach().t()


def _cat_bias(*linears) -> torch.Tensor | None:
    biases = [lin.bias for lin in linears]
    if all(b is None for b in biases):
        return None
    return torch.cat([b.detach() if b is not None else torch.zeros(lin.out_features, dtype=lin.weight.dtype,
                                                                    device=lin.weight.device)
                      for b, lin in zip(biases, linears)])


def layer_weights(layer: torch.nn.Module) -> LeanLayerWeights:
    """The lean weights of one transformers decoder layer (Qwen2-VL, Qwen2.5-VL, Qwen3-VL, Qwen3-VL-MoE)."""
    att, mlp = layer.self_attn, layer.mlp
    q, k, v, o = att.q_proj, att.k_proj, att.v_proj, att.o_proj
    qkv = torch.cat([q.weight.detach(), k.weight.detach(), v.weight.detach()])
    q_norm = getattr(att, "q_norm", None)
    k_norm = getattr(att, "k_norm", None)
    dense = hasattr(mlp, "gate_proj")
    gate_up = torch.cat([mlp.gate_proj.weight.detach(), mlp.up_proj.weight.detach()]) if dense else None
    return LeanLayerWeights(
        qkv_t=qkv.t(), qkv_bias=_cat_bias(q, k, v),
        o_t=_t(o.weight), o_bias=o.bias.detach() if o.bias is not None else None,
        input_norm=layer.input_layernorm.weight.detach(), post_norm=layer.post_attention_layernorm.weight.detach(),
        q_norm=q_norm.weight.detach() if q_norm is not None else None,
        k_norm=k_norm.weight.detach() if k_norm is not None else None,
        gate_up_t=gate_up.t() if dense else None, down_t=_t(mlp.down_proj.weight) if dense else None,
        moe=None if dense else mlp,
    )


def drop_hf_layers(language_model: torch.nn.Module) -> None:
    """Release transformers' own decoder layers once their weights are fused (MoE blocks stay
    referenced by the lean weights)."""
    language_model.layers = torch.nn.ModuleList()
