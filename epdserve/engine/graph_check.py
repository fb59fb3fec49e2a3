"""`graph_self_check(runner)`: the start-up check that a replayed decode step equals the eager one.

Run once, right after the start-up captures (ModelRunner.capture_graphs), before any request: one
decode step of the largest batch bucket up to 4 rows (so no padding row), every row a different
context length inside the KV cache's padding block (full, 3/4, 1/2, 1/4 of a block: a graph that
attended the capture's lengths, or the previous step's, answers differently), run eagerly and
then replayed. Both runs write the same K/V into the same padding-block slots before attending,
so they read the same cache. Any difference — a sampled token, or a logit beyond bf16 rounding —
turns graphs off for the engine with the reason (graph_report's why_off); no request's blocks
are touched.
"""
from __future__ import annotations

from array import array

import torch

from epdserve.engine.forward_inputs import ForwardInputs
from epdserve.ops.attention_meta import RequestSpan

_REL_TOL = 2e-2  # of the largest |logit|: bf16 rounding between two launches of the same kernels


@torch.inference_mode()
def graph_self_check(runner) -> str | None:
    """None where the replay matches eager; else why graphs must stay off."""
    graphs, kv = runner.graphs, runner.kv_cache
    bs, pad = kv.spec.block_size, kv.pad_block
    n = max(b for b in graphs.buckets if b <= 4)
    lens = [max(2, bs - r * max(1, bs // 4)) for r in range(n)]
    ids = array("q", [1 + r for r in range(n)])
    pos = array("q", [length - 1 for length in lens])
    slots = array("q", [pad * bs + length - 1 for length in lens])
    ctx = array("q", lens)
    tables = [[pad]] * n
    runner._ensure_positions(max(pos) + 1)
    spans = tuple(RequestSpan(k, 1, c, t) for k, (c, t) in enumerate(zip(ctx, tables)))
    eager = runner.lm.logits(runner.forward(ForwardInputs(ids, pos * 3, spans, slots, max(pos)))).float()
    key = graphs.key([_Row(t) for t in tables])
    if key is None:
        return "self-check: no graph bucket for its step"
    replayed = graphs.run(key, ids, (pos, pos, pos), slots, ctx, tables).float()
    want, got = eager.argmax(-1).tolist(), replayed.argmax(-1).tolist()
    diff = float((replayed - eager).abs().max())
    if want != got or diff > _REL_TOL * float(eager.abs().max()) + 1e-3:
        return (f"self-check: a replayed decode step differs from eager (tokens {got} vs {want}, "
                f"max |logit difference| {diff:.3g})")
    return None


class _Row:
    """What `DecodeGraphs.key` reads of a row: its block table."""

    def __init__(self, block_ids):
        self.block_ids = block_ids
