"""`DataParallelEncoder`: the vision encoder of a tensor-parallel instance, data-parallel over
its ranks (issue 47 item 4; vLLM's `mm_encoder_tp_mode="data"`, SGLang's
`--mm-enable-dp-encoder`).

Every rank holds the vision tower whole (it is ~1 % of a 72B model's weights). One encoder call's
media items are cut into `size` contiguous runs of about equal patches (`split_items`); rank 0
sends runs 1.. to their ranks over the group's sockets, encodes run 0 itself meanwhile, then
takes the others' features back and puts them in order — the list `VLMAdapter.encode_images`
would have returned. Each run is one encoder call of its own, so an item's features are those
of a smaller batch (the vision tower's attention never crosses items; only a GEMM's blocking may
change with the batch, as it already does between the encode stage's packings).

An encode that fails on a rank comes back as its error and is raised on rank 0 as the step's
error (the rank itself is fine); a rank gone raises `RankFailure`.
"""
from __future__ import annotations

import pickle
from collections.abc import Callable

import torch


def split_items(weights: list[int], parts: int) -> list[range]:
    """`parts` contiguous runs of the items (some may be empty), each about `sum / parts` by
    weight: item i goes to the run its start falls in (one item alone stays on rank 0)."""
    total = sum(weights) or 1
    bounds, acc, start = [], 0, 0
    for i, w in enumerate(weights):
        part = min(parts - 1, acc * parts // total)
        while len(bounds) < part:
            bounds.append(range(start, i))
            start = i
        acc += w
    while len(bounds) < parts - 1:
        bounds.append(range(start, len(weights)))
        start = len(weights)
    bounds.append(range(start, len(weights)))
    return bounds


class DataParallelEncoder:
    def __init__(self, group, local: Callable[[list, list], list[list[torch.Tensor]]], device):
        """`group`: the instance's TPGroup; `local(pixel_values, grids)`: rank 0's own encoder
        (`VLMAdapter.encode_images`)."""
        self.group, self.local, self.device = group, local, device
        self.items_by_rank = [0] * group.size  # media items (or video slices) each rank encoded

    def __call__(self, pixel_values: list[torch.Tensor], grids: list[torch.Tensor]) -> list[list[torch.Tensor]]:
        runs = split_items([int(pv.shape[0]) for pv in pixel_values], self.group.size)
        asked = []
        for rank, run in enumerate(runs[1:], 1):
            if len(run):
                self.group.send_to(rank, pickle.dumps(
                    ("encode", [pixel_values[i].cpu() for i in run], [grids[i].cpu() for i in run]),
                    protocol=pickle.HIGHEST_PROTOCOL))
                asked.append(rank)
        out = self.local([pixel_values[i] for i in runs[0]], [grids[i] for i in runs[0]]) if len(runs[0]) else []
        failure = None
        for rank in asked:  # every asked rank answers, even after another's failure: the sockets stay in step
            status, value = self.group.receive_from(rank)
            if status != "ok":
                failure = failure or RuntimeError(f"tensor-parallel rank {rank} failed to encode: {value}")
                continue
            out += [[t.to(self.device) for t in feats] for feats in value]
        if failure is not None:
            raise failure
        for rank, run in enumerate(runs):
            self.items_by_rank[rank] += len(run)
        return out
