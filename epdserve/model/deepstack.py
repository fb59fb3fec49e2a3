"""Qwen3-VL DeepStack: which hidden-state rows of a prompt chunk get which visual features.

transformers adds, after LM layer i, `deepstack[i]` of every visual token to that token's hidden
state (`Qwen3VLTextModel._deepstack_process`). With chunked prefill a chunk holds any part of a
prompt, an image possibly cut in two; `chunk_deepstack` returns the rows of the chunk that are
visual tokens and, per layer, the matching feature rows: a visual token's row is its rank among
the prompt's visual tokens, and the media's features are concatenated in prompt order (the
order transformers concatenates them in).
"""
from __future__ import annotations

import torch


def chunk_deepstack(prompt_ids: list[int], visual_ids: tuple[int, ...], media_features: list[list[torch.Tensor]],
                    start: int, end: int) -> tuple[list[int], list[torch.Tensor]] | None:
    """Deepstack inputs of prompt tokens [start, end): (chunk-relative rows, one [rows, hidden]
    tensor per deepstack layer), or None when the chunk has no visual token.

    `media_features[j]` is media j's feature list ([embeds, deepstack layer 0, 1, ...]); every
    item must have the same number of deepstack layers (at least one)."""
    end = min(end, len(prompt_ids))
    rows = [i - start for i in range(start, end) if prompt_ids[i] in visual_ids]
    if not rows:
        return None
    first = sum(1 for t in prompt_ids[:start] if t in visual_ids)  # rank of the chunk's first visual token
    lo, hi = first, first + len(rows)
    n_layers = len(media_features[0]) - 1
    per_layer: list[list[torch.Tensor]] = [[] for _ in range(n_layers)]
    seen = 0
    for feats in media_features:
        if len(feats) - 1 != n_layers:
            raise ValueError(f"media features hold {len(feats) - 1} deepstack layers, expected {n_layers}")
        n = feats[0].shape[0]
        a, b = max(lo, seen), min(hi, seen + n)
        if a < b:
            for layer in range(n_layers):
                per_layer[layer].append(feats[1 + layer][a - seen : b - seen])
        seen += n
    if seen < hi:
        raise ValueError(f"prompt has at least {hi} visual tokens but the media's features cover {seen}")
    return rows, [torch.cat(parts) for parts in per_layer]
