"""Which part of the LM a tensor-parallel rank holds (Megatron's split, as vLLM's and SGLang's).

Per decoder layer: the fused QKV projection is split by attention head (column-parallel), the
output projection by its input rows (row-parallel), gate-up by MLP columns and down by its input
rows; each rank's partial output projection and down projection are summed by one all-reduce
each. Rank r holds query heads [r·H/tp, (r+1)·H/tp) and the KV heads they attend: KVH/tp of
them when tp divides the KV heads, else — tp a multiple of KVH — the one KV head its query heads
share, which tp/KVH ranks then hold alike (vLLM's `num_kv_head_replicas`). Each rank's KV cache
holds its own KV heads only. Norms (Qwen3's per-head q/k norms too), the embedding and the LM
head are replicated: every rank holds them whole (the LM head runs on rank 0 only). A bias of a
row-parallel projection is added by rank 0 alone, so the sum counts it once. A sparse (MoE)
layer's experts are split over the ranks whole (`expert_range`: expert parallelism over the same
group, engine/lm/experts.py); its router is replicated. engine/lm/shard_loader.py
reads each rank's slices from the checkpoint by this map.
"""
from __future__ import annotations

from dataclasses import dataclass

from epdserve.kv_layout import rank_kv_heads


@dataclass(frozen=True)
class TPShard:
    rank: int
    size: int


def valid_degrees(num_heads: int, num_kv_heads: int, intermediate: int, num_experts: int = 0) -> list[int]:
    """The degrees that split this LM: dividing the attention heads, the MLP width and the experts
    (a sparse model's), and either dividing the KV heads or a multiple of them."""
    return [d for d in range(1, num_heads + 1)
            if num_heads % d == 0 and intermediate % d == 0 and (num_kv_heads % d == 0 or d % num_kv_heads == 0)
            and (not num_experts or num_experts % d == 0)]


def check_degree(tp: int, num_heads: int, num_kv_heads: int, intermediate: int, num_experts: int = 0) -> None:
    """ValueError naming the model's numbers and the valid degrees unless `tp` is one."""
    valid = valid_degrees(num_heads, num_kv_heads, intermediate, num_experts)
    if tp not in valid:
        experts = f", {num_experts} experts" if num_experts else ""
        raise ValueError(f"tensor_parallel_size={tp} does not split this model ({num_heads} attention heads, "
                         f"{num_kv_heads} KV heads, MLP width {intermediate}{experts}); valid degrees: "
                         f"{', '.join(map(str, valid))}")


def num_experts(text_config) -> int:
    """A sparse model's experts per layer (0: dense)."""
    return getattr(text_config, "num_experts", 0) or 0


def check_model_degree(text_config, tp: int) -> None:
    """`check_degree` with a checkpoint's own numbers (its `config.json` text config)."""
    check_degree(tp, text_config.num_attention_heads, text_config.num_key_value_heads,
                 int(text_config.intermediate_size), num_experts(text_config))


def expert_range(num_experts: int, shard: TPShard) -> range:
    """The experts `shard`'s rank holds (expert parallelism over the TP group)."""
    per = num_experts // shard.size
    return range(shard.rank * per, (shard.rank + 1) * per)


def sparse_layer(text_config, i: int) -> bool:
    """Whether decoder layer i is a sparse (MoE) layer (transformers' Qwen3-VL-MoE rule:
    modeling_qwen3_vl_moe.py Qwen3VLMoeTextDecoderLayer)."""
    return num_experts(text_config) > 0 and i not in (getattr(text_config, "mlp_only_layers", None) or []) \
        and (i + 1) % getattr(text_config, "decoder_sparse_step", 1) == 0


def head_map(num_heads: int, num_kv_heads: int, shard: TPShard) -> tuple[range, range]:
    """(query heads, KV heads) of `shard`'s rank (the KV heads by kv_layout.py's `rank_kv_heads`,
    the rule the registration record states)."""
    per = num_heads // shard.size
    return range(shard.rank * per, (shard.rank + 1) * per), rank_kv_heads(num_kv_heads, shard.size, shard.rank)
