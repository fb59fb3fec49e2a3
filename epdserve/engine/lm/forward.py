"""`LeanLM`: the language model's forward over one step's packed tokens.

Per layer (T packed tokens, no batch dimension):
    x, residual = add_rms_norm(h, residual)          # one fused operator (LayerOps)
    qkv = x @ W_qkv (+ b)                             # one GEMM
    q, k = rotary(q_norm(q), k_norm(k), cos, sin)     # Qwen3's per-head norms; one fused rotary
    o = paged_attend(q, k, v)                         # cache write + attention (PagedOps)
    h = o @ W_o
    x, residual = add_rms_norm(h, residual)
    h = silu_and_mul(x @ W_gate_up) @ W_down          # or transformers' sparse MoE block
The residual add is deferred into the next norm, as transformers rounds it (`residual + h` in the
model's dtype). DeepStack layers (Qwen3-VL prompt chunks) materialize the sum, add the visual
features to their rows, and continue, as transformers' `_deepstack_process` does. The KV
connector's hooks bracket each layer (`wait_for_layer_load(i)` before, `save_kv_layer(i)`
after). Nothing in the loop reads the device or branches on tensor values, so a decode step can
be captured as a graph (engine/graph_runner.py).
Under tensor parallelism (`shard`, engine/tp/shard.py) a rank holds its heads and MLP columns
only (engine/lm/shard_loader.py reads just those), and `reduce` sums the output projection's and the MLP's partial results over the group
(one all-reduce each per layer) before the residual add; a sparse layer's experts are split
over the ranks (engine/lm/experts.py) and summed by the same all-reduce.
"""
from __future__ import annotations

import torch

from epdserve.engine.lm.linear import DenseLinear, Linear, make_linear
from epdserve.engine.lm.rotary import RotaryTable
from epdserve.engine.lm.weights import LeanLayerWeights, drop_hf_layers, layer_weights
from epdserve.engine.tp.shard import TPShard, head_map
from epdserve.ops.attention_meta import AttentionMeta
from epdserve.ops.layer_ops import LayerOps, LayerShapes
from epdserve.ops.paged_attention import paged_attend


class LeanLM:
    """The fused weights of the LM (built once per process from the loaded model) and its forward;
    stateless across calls, so engines on several threads may share it."""

    def __init__(self, adapter, max_positions: int, layers: list[LeanLayerWeights] | None = None,
                 shard: TPShard = TPShard(0, 1), method: str = "dense", platform: str = "cpu"):
        """`layers`: the decoder layers read by engine/lm/shard_loader.py (`shard`'s part of them), else
        they are taken from transformers' own layers (which are then released), their projections
        held by `method` on `platform` (engine/lm/linear.py `linear_class`)."""
        tc = adapter.text_config
        lm = adapter.base.language_model
        if layers is None:
            layers = [layer_weights(layer, method, platform) for layer in lm.layers]
            drop_hf_layers(lm)
        self.layers: list[LeanLayerWeights] = layers
        self.shard = shard
        self.embed_weight = adapter.embed.weight.detach()
        self.norm_weight = adapter.norm.weight.detach()
        self.head: Linear | None = _head(adapter, platform)  # None on a TP rank other than 0 (engine/tp_rank.py)
        self.eps = float(tc.rms_norm_eps)
        self.head_dim = adapter.head_dim
        q, kv = head_map(adapter.num_heads, adapter.num_kv_heads, shard)
        self._set_heads(len(q), len(kv))
        self.scale = self.head_dim ** -0.5
        self.rotary = RotaryTable(adapter.rotary, self.head_dim, max_positions, adapter.dtype, adapter.device)
        self.reduce = None  # tensor parallelism: sums a partial result over the group, in place

    def _set_heads(self, num_heads: int, num_kv_heads: int) -> None:
        self.num_heads, self.num_kv_heads = num_heads, num_kv_heads
        self.q_width = num_heads * self.head_dim
        self.kv_width = num_kv_heads * self.head_dim
        self.qkv_split = (self.q_width, self.kv_width, self.kv_width)

    def layer_shapes(self) -> LayerShapes:
        """A layer's sizes as its `LayerOps` see them (this rank's heads; the first dense MLP's width)."""
        hidden = int(self.norm_weight.shape[0])
        inter = next((w.gate_up.out_features // 2 for w in self.layers if w.gate_up is not None), hidden)
        return LayerShapes(hidden, self.num_heads, self.num_kv_heads, self.head_dim, inter, self.norm_weight.dtype)

    def tensors(self) -> list[torch.Tensor]:
        """Every tensor the forward reads (weights, rotary tables), each once."""
        out = [self.embed_weight, self.norm_weight, *self._head_tensors(), self.rotary.cos, self.rotary.sin,
               self.rotary.axis, self.rotary.cols]
        for w in self.layers:
            out += w.tensors()
        return out

    def num_parameters(self) -> int:
        """Parameters of the LM (embedding, layers, final norm, LM head; a tied head counted once)."""
        seen, n = set(), 0
        for t in [self.embed_weight, self.norm_weight, *self._head_tensors(),
                  *(t for w in self.layers for t in w.tensors())]:
            # an opaque oneDNN weight (engine/lm/prepacked_linear.py) has no storage: it is its own key
            key = ("opaque", id(t)) if t.is_mkldnn else (t.untyped_storage().data_ptr(), t.storage_offset(), t.numel())
            if key not in seen:
                seen.add(key)
                n += t.numel()
        return n

    def embed(self, token_ids: torch.Tensor) -> torch.Tensor:
        return torch.nn.functional.embedding(token_ids, self.embed_weight)

    def forward(self, hidden: torch.Tensor, positions: torch.Tensor, meta: AttentionMeta, ops: LayerOps,
                connector=None, deepstack=None) -> torch.Tensor:
        """hidden [T, hidden] (embeddings), positions [3, T] → the last layer's output, normed [T, hidden].

        `deepstack`: (rows [n] on the device, one [n, hidden] feature per deepstack layer) or None."""
        cos, sin = self.rotary.gather(positions)
        T = hidden.shape[0]
        h, residual = hidden, None
        qw, H, KVH, d = self.q_width, self.num_heads, self.num_kv_heads, self.head_dim
        if connector is not None:
            connector.start_load_kv()
        for i, w in enumerate(self.layers):
            if connector is not None:
                connector.wait_for_layer_load(i)
            x, residual = ops.add_rms_norm(h, residual, w.input_norm, self.eps)
            qkv = w.qkv(x)
            q, k, v = qkv.split(self.qkv_split, dim=1)
            q, k, v = q.view(T, H, d), k.view(T, KVH, d), v.view(T, KVH, d)
            if w.q_norm is not None:
                q, k = ops.rms_norm(q, w.q_norm, self.eps), ops.rms_norm(k, w.k_norm, self.eps)
            q, k = ops.rotary(q, k, cos, sin)
            o = paged_attend(q, k, v, i, meta, self.scale)
            h = w.o(o.reshape(T, qw))
            if self.reduce is not None:
                self.reduce(h)
            x, residual = ops.add_rms_norm(h, residual, w.post_norm, self.eps)
            if w.moe is None:
                h = w.down(ops.silu_and_mul(w.gate_up(x)))
            else:
                h = w.moe(x.unsqueeze(0))[0]
            if self.reduce is not None:  # a sparse layer's part: its rank's experts (engine/lm/experts.py)
                self.reduce(h)
            if deepstack is not None and i < len(deepstack[1]):
                rows = deepstack[0]
                h = residual + h
                h[rows] = h[rows] + deepstack[1][i]
                residual = None
            if connector is not None:
                connector.save_kv_layer(i)
        if connector is not None:
            connector.wait_for_save()
        return ops.add_rms_norm(h, residual, self.norm_weight, self.eps)[0]

    def logits(self, normed: torch.Tensor) -> torch.Tensor:
        return self.head(normed)

    def _head_tensors(self) -> list[torch.Tensor]:
        return self.head.tensors() if self.head is not None else []


def _head(adapter, platform: str) -> Linear:
    """The LM head as a projection: tied to the embedding, the embedding's own weight (a view, no
    copy); else held as "dense" holds it on `platform` (prepacked for oneDNN on the CPU, the
    row-major copy then released)."""
    weight = adapter.lm_head.weight.detach()
    if weight.data_ptr() == adapter.embed.weight.data_ptr():
        return DenseLinear([weight])
    head = make_linear([weight], platform=platform)
    if not isinstance(head, DenseLinear):
        adapter.lm_head.weight.data = torch.empty(0, dtype=weight.dtype, device=weight.device)
    return head
