"""`PagedOps`: the three paged-KV operators attention needs, behind one interface per platform.

- `reshape_and_cache(key, value, key_cache, value_cache, slots)`: write a packed batch's new K/V
  ([T, kv_heads, head_dim]) into the paged cache ([num_blocks, block_size, kv_heads, head_dim])
  at flat slots [T] (slot = block * block_size + offset), in place;
- `decode_attention(query, key_cache, value_cache, block_tables, ctx_lens, scale)`: one query
  token per request ([B, heads, head_dim]) against its first `ctx_lens[b]` cached tokens, read
  through `block_tables` [B, max_blocks] (int64, padded with any valid id); GQA by
  heads // kv_heads; returns [B, heads, head_dim];
- `prefill_attention(query, key_cache, value_cache, block_table, ctx_len, scale)`: a later chunk
  of one prompt ([q_len, heads, head_dim], its K/V already in the cache) against the request's
  `ctx_len` cached tokens, causally (query i sits at position ctx_len - q_len + i).

Step-level contract: `index_dtype` is the dtype the engine uploads slots and block tables in,
once per step (ops/attention_meta.py), so no operator casts them per layer. Ops with
`attends_varlen` implement `varlen_attention(query, key_cache, value_cache, batch, scale)`: the
whole packed batch ([T, heads, head_dim]; every request's K/V already in the cache) in one
call, causally per request, from an `attention_meta.VarlenBatch` whose lengths are host ints;
the engine then calls neither `decode_attention` nor `prefill_attention`.

Implementations: `PortableOps` (torch: gather + SDPA; any device), `NativeOps` (csrc/ C++
kernels registered as `torch.ops.epdserve.*`, reading the blocks where they lie), `TritonOps`
(CUDA: decode attention as a Triton kernel reading the blocks where they lie, the KV write as
one Triton kernel), and the NPU one
over torch_npu's kernels. `ops.select.paged_ops(platform)` picks one.
"""
from __future__ import annotations

from abc import ABC, abstractmethod
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from epdserve.ops.attention_meta import VarlenBatch


class PagedOps(ABC):
    name: str
    index_dtype: torch.dtype = torch.long
    attends_varlen: bool = False

    def varlen_attention(self, query: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
                         batch: VarlenBatch, scale: float) -> torch.Tensor:
        raise NotImplementedError(f"{self.name} ops attend decode and prefill requests separately")

    def graph_tasks(self):
        """For a decode graph about to be captured: a recorder of the calls whose host arguments
        (lengths) must be re-issued before each replay, with `update(q_ends, kv_lens)`; the graph
        runner puts it in the capture's `VarlenBatch.graph_tasks`. None (the default): nothing to
        update (the lengths these ops read are device tensors)."""
        return None

    def graphs_unavailable_reason(self) -> str | None:
        """Why these operators cannot be captured in a decode graph, in one line (None: they can)."""
        return None

    def check_kv_spec(self, spec, num_heads: int, device: torch.device) -> None:
        """Raise, with the fix, when these operators cannot attend a model whose KV cache is `spec`
        (a KVCacheSpec) with `num_heads` query heads on `device`. Called once at engine start-up,
        before the KV cache is allocated. Default: anything goes."""

    @abstractmethod
    def reshape_and_cache(self, key: torch.Tensor, value: torch.Tensor, key_cache: torch.Tensor,
                          value_cache: torch.Tensor, slots: torch.Tensor) -> None: ...

    @abstractmethod
    def decode_attention(self, query: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
                         block_tables: torch.Tensor, ctx_lens: torch.Tensor, scale: float) -> torch.Tensor: ...

    @abstractmethod
    def prefill_attention(self, query: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
                          block_table: torch.Tensor, ctx_len: int, scale: float) -> torch.Tensor: ...
