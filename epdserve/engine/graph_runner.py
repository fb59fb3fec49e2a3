"""`DecodeGraphs`: decode steps replayed from captured device graphs (CUDA graphs on CUDA,
torch.npu.NPUGraph on Ascend: platform/npu_graphs.py).

A decode-only step of B requests whose block tables are at most W blocks wide runs the graph
captured for the bucket (B', W') >= (B, W): batch buckets 1, 2, 4, 8, then steps of 8 up to
`max_batch`; width buckets powers of two from 8 blocks up to the context length. Its inputs are
laid out per bucket (token ids, M-RoPE positions, slots, context lengths: B' each; block tables
B' x W') and uploaded by the step's one copy straight into the static device buffer the graph
was captured reading (engine/step_buffers.py `dest`); padding rows decode a dummy token into the
KV cache's padding block (engine/kv_cache.py `pad_block`), attending only to it. The graph runs
embed → layers → final norm → LM head into one logits buffer every graph shares (fp32 [the largest
batch bucket, vocab], allocated at the first warm-up, outside any capture: a graph's output is
its first rows, so no graph keeps a [batch, vocab] buffer of its own — ~0.6 GB per bucket of 32 at
a 152k vocabulary); sampling stays eager and reads it before the next replay writes it. Ops whose
attention reads host lengths (the NPU's FIA: `PagedOps.graph_tasks`) capture it as re-issuable
tasks (ops/npu_graph_fia.py), and each replay is preceded by their update with the step's
lengths (a padding row's: 1). Graphs
share one memory pool, captured from the largest batch down, each bucket run once eagerly right
before its capture. The widths the first request needs
are captured at start-up for every batch bucket — every width bucket up to the start-up context's
(256 tokens: widths 8 and 16 at 16-token blocks) — (time reported); a wider bucket is captured
when first needed, at most `max_graphs` in all (beyond that, such steps run eagerly).

Steps that run eagerly instead: any step with a prompt chunk, any step whose KV connector works
per layer (P's layerwise sends), Qwen3-VL-MoE (its expert routing reads the device), and every
step with `--enforce-eager`.
"""
from __future__ import annotations

import logging
import time
from array import array

import torch

from epdserve.ops.attention_meta import AttentionMeta, StepPacker, VarlenBatch

log = logging.getLogger(__name__)
MIN_WIDTH = 8  # blocks


def batch_buckets(max_batch: int) -> list[int]:
    out = [b for b in (1, 2, 4, 8) if b < max_batch]
    out += list(range(16, max_batch, 8))
    return out + [max_batch]


class DecodeGraphs:
    def __init__(self, lm, kv_cache, paged_ops, layer_ops, platform, buffers, max_batch: int, max_blocks: int,
                 max_graphs: int = 64):
        self.lm, self.kv_cache, self.paged_ops, self.layer_ops = lm, kv_cache, paged_ops, layer_ops
        self.platform, self.buffers = platform, buffers
        self.buckets = batch_buckets(max_batch)
        self.max_blocks = max_blocks
        self.max_graphs = max_graphs
        self.bs = kv_cache.spec.block_size
        self.pad_slot = kv_cache.pad_block * self.bs
        self.graphs: dict[tuple[int, int], tuple[object, torch.Tensor, object]] = {}  # graph, logits, tasks
        self.pool = None
        need = max(self._layout_bytes(b, self._width(max_blocks)) for b in self.buckets)
        self.static = torch.empty(need, dtype=torch.uint8, device=kv_cache.keys[0].device)
        self.capture_s = 0.0
        self.logits: torch.Tensor | None = None  # the graphs' one output buffer (see the module docstring)

    def _width(self, blocks: int) -> int:
        w = MIN_WIDTH
        while w < blocks:
            w *= 2
        return min(w, max(self.max_blocks, MIN_WIDTH))

    @staticmethod
    def _layout_bytes(b: int, w: int) -> int:
        return 8 * (6 * b + b * w) + 64

    def key(self, batch) -> tuple[int, int] | None:
        """The bucket of a decode-only batch, or None (too big / no graph and no room for one)."""
        n = len(batch)
        bp = next((b for b in self.buckets if b >= n), None)
        if bp is None:
            return None
        k = (bp, self._width(max(len(item.block_ids) for item in batch)))
        if k in self.graphs or len(self.graphs) < self.max_graphs:
            return k
        return None

    def _pack(self, bp: int, w: int, ids, pos, slots, ctx, tables) -> StepPacker:
        n = len(ids)
        pad = bp - n
        idt = self.paged_ops.index_dtype  # slots, lengths, tables as the ops take them (int32 on the NPU)
        p = StepPacker()
        p.add(array("q", ids) + array("q", [0]) * pad, torch.int64)
        zeros = array("q", [0]) * pad
        p.add(array("q", pos[0]) + zeros + array("q", pos[1]) + zeros + array("q", pos[2]) + zeros, torch.int64,
              (3, bp))
        p.add(array("q", slots) + array("q", [self.pad_slot]) * pad, idt)
        p.add(array("q", ctx) + array("q", [1]) * pad, idt)
        p.add_table(list(tables) + [[self.kv_cache.pad_block]] * pad, idt, pad=self.kv_cache.pad_block, width=w)
        return p

    def run(self, key, ids, pos, slots, ctx, tables) -> torch.Tensor:
        """Logits [len(ids), vocab] (fp32) of a decode step, replayed (captured first if new)."""
        bp, w = key
        if key not in self.graphs:
            self._capture(key)
        self.buffers.upload(self._pack(bp, w, ids, pos, slots, ctx, tables), dest=self.static)
        graph, logits, tasks = self.graphs[key]
        if tasks is not None:  # the step's host lengths into the captured attention launches
            tasks.update(list(range(1, bp + 1)), list(ctx) + [1] * (bp - len(ids)))
        graph.replay()
        return logits[: len(ids)]

    def _body(self, bp: int, w: int, tasks=None) -> torch.Tensor:
        views = self._pack(bp, w, [], [[], [], []], [], [], []).views(self.static)
        ids, positions, slots, ctx, tables = views
        empty = ids[:0]
        if self.paged_ops.attends_varlen:  # host lengths: the capture's (all 1), updated per replay by `tasks`
            varlen = VarlenBatch(tables, tuple(range(1, bp + 1)), (1,) * bp, tasks)
            meta = AttentionMeta(self.kv_cache, self.paged_ops, slots, [], empty, tables[:0], empty, varlen=varlen)
        else:
            meta = AttentionMeta(self.kv_cache, self.paged_ops, slots, [], empty, tables, ctx, decode_only=True)
        normed = self.lm.forward(self.lm.embed(ids), positions, meta, self.layer_ops)
        logits = self.lm.logits(normed)
        if self.logits is None:  # the first warm-up, eager: never inside a capture
            self.logits = torch.empty(self.buckets[-1], logits.shape[-1], dtype=torch.float32, device=logits.device)
        return self.logits[:bp].copy_(logits)  # copy_ casts: for bf16 the one kernel .float() was

    @torch.inference_mode()
    def _capture(self, key) -> None:
        bp, w = key
        t0 = time.perf_counter()
        self.buffers.upload(self._pack(bp, w, [], [[], [], []], [], [], []), dest=self.static)
        # every bucket runs once eagerly before its capture (as nano-vllm and vLLM warm each size): its
        # shapes' kernels are chosen, compiled (Triton's JIT specializes on strides) and loaded outside
        # the capture, where a compile or a library's first call would break it
        self._body(bp, w)
        self.platform.synchronize()
        if self.pool is None:
            self.pool = self.platform.graph_pool()
        tasks = self.paged_ops.graph_tasks()
        graph, logits = self.platform.capture_graph(lambda: self._body(bp, w, tasks), self.pool)
        self.platform.synchronize()
        self.graphs[key] = (graph, logits, tasks)
        self.capture_s += time.perf_counter() - t0

    def capture_startup(self, blocks: int) -> float:
        """Capture every batch bucket at every width bucket up to the one `blocks` falls in (8, 16,
        ...: a short request's width is captured too, not mid-run), widest and largest batch first;
        seconds taken."""
        t0 = time.perf_counter()
        widths = [MIN_WIDTH]
        while widths[-1] < self._width(blocks):
            widths.append(self._width(widths[-1] + 1))
        for w in reversed(widths):
            for bp in reversed(self.buckets):
                if (bp, w) not in self.graphs and len(self.graphs) < self.max_graphs:
                    self._capture((bp, w))
        return time.perf_counter() - t0

    def reset(self) -> None:
        """Forget every graph (the tables they read were replaced)."""
        self.graphs.clear()
