"""Encode batching under a vision-token budget: which media, or pieces of them, one E step encodes.

An `EncodeJob` is one media key being encoded, possibly over several steps: an image whole, a
video whole or a few of its temporal patches at a time. `pack` fills one encoder call with
slices of jobs up to `budget` vision tokens (LM tokens, after the spatial merge), taking them
round-robin across requests, the request served least recently first (then the earliest
arrival), so a request with many images or a long video cannot hold E while a small request
waits: each step gives every waiting request a slice before any gets a second one. A slice
larger than the budget still runs, alone in its step: an image is never cut, a video is cut
down to one temporal patch at most.

Cutting a video at temporal patches is exact where the vision tower treats each temporal patch
on its own. In transformers 5.x, Qwen2-VL, Qwen2.5-VL and Qwen3-VL(-MoE) attend within one
temporal patch (`vision_utils.get_vision_cu_seqlens(merge_temporal=False)`: one segment per
patch; Qwen2.5-VL's windows too, `get_vision_window_index`), take rotary positions from (h, w)
only (`get_vision_position_ids`, repeated over t), Qwen3-VL's learned position embedding per
frame (`get_vision_interpolation_indices_and_weights`), and merge (DeepStack mergers included)
per merged token. So encoding patches [a, b) of a video with grid (b - a, h, w) gives rows
[a·n, b·n) of the whole video's features, n = h·w / merge² (tests/engine/test_encode_budget.py
checks it). Any other architecture encodes each item whole.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

from epdserve.engine.request_parts import MediaItem
from epdserve.engine.sequence import Sequence

TEMPORAL_SLICING_EXACT = frozenset({"qwen2_vl", "qwen2_5_vl", "qwen3_vl", "qwen3_vl_moe"})


@dataclass(eq=False)
class EncodeJob:
    item: MediaItem  # whose pixels are encoded (other items with the same key wait for it)
    tokens_per_patch: int  # vision tokens of one temporal patch
    sliceable: bool  # may be encoded a few temporal patches at a time
    next_patch: int = 0  # first temporal patch not yet given to an encoder call
    parts: list[list[torch.Tensor]] = field(default_factory=list)  # features of the slices so far, in order
    patches_done: int = 0

    @property
    def patches(self) -> int:
        return int(self.item.grid_thw.reshape(3)[0])

    @property
    def complete(self) -> bool:
        return self.patches_done == self.patches

    def fit(self, room: int, alone: bool) -> int:
        """Temporal patches of the next slice within `room` tokens (at least one when `alone`); 0: none fit."""
        left = self.patches - self.next_patch
        if not self.sliceable:
            return left if left and (alone or left * self.tokens_per_patch <= room) else 0
        n = min(left, room // self.tokens_per_patch)
        return max(n, 1 if alone and left else 0)

    def slice_input(self, start: int, end: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(pixel rows, grid) of temporal patches [start, end)."""
        t, h, w = (int(x) for x in self.item.grid_thw.reshape(3))
        if (start, end) == (0, t):
            return self.item.input.pixel_values, self.item.grid_thw
        return self.item.input.pixel_values[start * h * w:end * h * w], torch.tensor([end - start, h, w])

    def add_part(self, features: list[torch.Tensor], patches: int) -> None:
        self.parts.append(features)
        self.patches_done += patches

    def features(self) -> list[torch.Tensor]:
        """The whole item's features: its slices' tensors concatenated in patch order."""
        if len(self.parts) == 1:
            return self.parts[0]
        return [torch.cat(ts) for ts in zip(*self.parts)]


@dataclass
class Slice:
    job: EncodeJob
    start: int
    end: int

    @property
    def tokens(self) -> int:
        return (self.end - self.start) * self.job.tokens_per_patch


def pack(queues: list[tuple[Sequence, list[EncodeJob]]], budget: int, per_request: int | None = None
         ) -> tuple[list[Slice], list[Sequence]]:
    """One encoder call's slices, and the requests served. `queues`: each request's unfinished
    jobs in prompt order, the requests in serving order (least recently served first). Reserves
    the slices (advances `next_patch`); a job's slices within one call are merged into one.
    `per_request`: at most this many slices of one request per call (an E feeding pipelined
    prefill: each item is stored, and its prefill side told, as soon as it is done)."""
    out: list[Slice] = []
    served: list[Sequence] = []
    room, blocked = budget, set()
    while True:
        progressed = False
        for seq, jobs in queues:
            if id(seq) in blocked:
                continue
            job = next((j for j in jobs if j.next_patch < j.patches), None)
            n = job.fit(room, alone=not out) if job is not None else 0
            if n == 0:  # a request's media go in order: it waits for the next step
                blocked.add(id(seq))
                continue
            last = next((s for s in out if s.job is job and s.end == job.next_patch), None)
            if last is not None:
                last.end += n
            else:
                out.append(Slice(job, job.next_patch, job.next_patch + n))
            job.next_patch += n
            room -= n * job.tokens_per_patch
            if not any(r is seq for r in served):
                served.append(seq)
            progressed = True
            if per_request is not None and sum(1 for x in out if any(x.job is j for j in jobs)) >= per_request:
                blocked.add(id(seq))
        if not progressed:
            return out, served
