"""Which part of the LM a tensor-parallel rank holds (Megatron's split, as vLLM's and SGLang's).

Per decoder layer: the fused QKV projection is split by attention head (column-parallel), the
output projection by its input rows (row-parallel), gate-up by MLP columns and down by its input
rows; each rank's partial output projection and down projection are summed by one all-reduce
each. Rank r holds query heads [r·H/tp, (r+1)·H/tp) and the KV heads they attend: KVH/tp of
them when tp divides the KV heads, else — tp a multiple of KVH — the one KV head its query heads
share, which tp/KVH ranks then hold alike (vLLM's `num_kv_head_replicas`). Each rank's KV cache
holds its own KV heads only. Norms (Qwen3's per-head q/k norms too), the embedding and the LM
head are replicated: every rank holds them whole (the LM head runs on rank 0 only). A bias of a
row-parallel projection is added by rank 0 alone, so the sum counts it once.
"""
from __future__ import annotations

from dataclasses import dataclass, replace

import torch

from epdserve.engine.lm.weights import LeanLayerWeights


@dataclass(frozen=True)
class TPShard:
    rank: int
    size: int


def valid_degrees(num_heads: int, num_kv_heads: int, intermediate: int) -> list[int]:
    """The degrees that split this LM: dividing the attention heads and the MLP width, and either
    dividing the KV heads or a multiple of them."""
    return [d for d in range(1, num_heads + 1)
            if num_heads % d == 0 and intermediate % d == 0 and (num_kv_heads % d == 0 or d % num_kv_heads == 0)]


def check_degree(tp: int, num_heads: int, num_kv_heads: int, intermediate: int) -> None:
    """ValueError naming the model's numbers and the valid degrees unless `tp` is one."""
    valid = valid_degrees(num_heads, num_kv_heads, intermediate)
    if tp not in valid:
        raise ValueError(f"tensor_parallel_size={tp} does not split this model ({num_heads} attention heads, "
                         f"{num_kv_heads} KV heads, MLP width {intermediate}); valid degrees: "
                         f"{', '.join(map(str, valid))}")


def head_map(num_heads: int, num_kv_heads: int, shard: TPShard) -> tuple[range, range]:
    """(query heads, KV heads) of `shard`'s rank."""
    per = num_heads // shard.size
    q = range(shard.rank * per, (shard.rank + 1) * per)
    if shard.size <= num_kv_heads:
        k = num_kv_heads // shard.size
        return q, range(shard.rank * k, (shard.rank + 1) * k)
    kv = shard.rank * num_kv_heads // shard.size
    return q, range(kv, kv + 1)


def _cols(heads: range, head_dim: int, offset: int = 0) -> list[int]:
    return list(range(offset + heads.start * head_dim, offset + heads.stop * head_dim))


def shard_layer(w: LeanLayerWeights, num_heads: int, num_kv_heads: int, head_dim: int,
                shard: TPShard) -> LeanLayerWeights:
    """The rank's slice of one layer's lean weights (each slice a fresh contiguous tensor, stored
    transposed as the lean forward reads it)."""
    if w.moe is not None:
        raise ValueError("tensor parallelism of a sparse (MoE) layer is not supported yet (expert parallelism: "
                         "issue 47 item 3); run Qwen3-VL-MoE at tensor_parallel_size=1")
    q, kv = head_map(num_heads, num_kv_heads, shard)
    qw, kw = num_heads * head_dim, num_kv_heads * head_dim
    rows = _cols(q, head_dim) + _cols(kv, head_dim, qw) + _cols(kv, head_dim, qw + kw)
    idx = torch.tensor(rows, device=w.qkv_t.device)
    qkv = w.qkv_t.t().index_select(0, idx).contiguous()  # [local out, hidden]
    o_in = torch.tensor(_cols(q, head_dim), device=w.o_t.device)
    o = w.o_t.t().index_select(1, o_in).contiguous()  # [hidden, local q width]
    inter = w.down_t.shape[0]
    part = inter // shard.size
    mine = list(range(shard.rank * part, (shard.rank + 1) * part))
    gu_rows = torch.tensor(mine + [inter + i for i in mine], device=w.gate_up_t.device)
    gate_up = w.gate_up_t.t().index_select(0, gu_rows).contiguous()  # [2 local I, hidden]
    down = w.down_t.t().index_select(1, torch.tensor(mine, device=w.down_t.device)).contiguous()  # [hidden, local I]
    return replace(
        w, qkv_t=qkv.t(), qkv_bias=None if w.qkv_bias is None else w.qkv_bias.index_select(0, idx).contiguous(),
        o_t=o.t(), o_bias=w.o_bias if shard.rank == 0 else None, gate_up_t=gate_up.t(), down_t=down.t())
