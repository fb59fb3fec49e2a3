"""`ForwardInputs`: everything one LM forward over a step's packed tokens reads, on the host.

The model runner builds it from a `ScheduledStep` (engine/model_runner.py) and runs the forward
from it alone, so a tensor-parallel rank other than 0, which has no scheduler and no requests,
runs the same forward from the copy rank 0 sends it (engine/tp/). Integers travel as `array`s
(what the step packs into its one upload); the only tensors are what is not an integer: a
prompt chunk's embedding rows where media features replace placeholder tokens, and Qwen3-VL's
DeepStack features of the chunk's visual tokens.
"""
from __future__ import annotations

from array import array
from dataclasses import dataclass

import torch

from epdserve.ops.attention_meta import RequestSpan


@dataclass(frozen=True)
class ForwardInputs:
    ids: array  # int64 [T]: the packed tokens
    positions: array  # int64 [3 * T]: M-RoPE positions, axis-major
    spans: tuple[RequestSpan, ...]  # per request: its rows, context length and block table
    slots: array  # int64 [T]: each token's flat KV cache slot
    top_position: int  # the largest position (the rotary tables must reach it)
    sample_rows: array | None = None  # packed rows whose logits are wanted; None: every row
    embed_rows: tuple[tuple[int, torch.Tensor], ...] = ()  # (first packed row, [n, hidden] embeddings)
    deepstack: tuple[tuple[int, ...], list[torch.Tensor]] | None = None  # (packed rows, feature per layer)

    def to_host(self) -> "ForwardInputs":
        """A copy whose tensors are on the host (what crosses to another process)."""
        if not self.embed_rows and self.deepstack is None:
            return self
        rows = tuple((off, t.cpu()) for off, t in self.embed_rows)
        ds = None if self.deepstack is None else (self.deepstack[0], [t.cpu() for t in self.deepstack[1]])
        return ForwardInputs(self.ids, self.positions, self.spans, self.slots, self.top_position, self.sample_rows,
                             rows, ds)
