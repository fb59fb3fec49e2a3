"""Sampler: next token per request from its logits row, honouring that request's params.

Greedy rows take argmax; sampled rows apply temperature, then min-p, top-k, top-p (vLLM v1's
order: min-p is computed on the temperature-scaled distribution over the whole vocabulary),
then draw with the request's own generator (seeded requests reproduce whatever they are
batched with).
"""
from __future__ import annotations

import torch

from epdserve.engine.sampling_params import SamplingParams


def sample(logits: torch.Tensor, params: list[SamplingParams], generators: list[torch.Generator | None]) -> list[int]:
    """logits [N, V] (fp32) → N token ids, read back from the device once (no per-row sync)."""
    picked = logits.argmax(dim=-1)
    drawn = [(i, _sample_row(logits[i], p, generators[i])) for i, p in enumerate(params) if not p.greedy]
    for i, t in drawn:  # device-side writes; nothing is uploaded or read back per row
        picked[i : i + 1] = t
    return picked.tolist()


def filtered_logits(row: torch.Tensor, p: SamplingParams) -> torch.Tensor:
    """`row` / temperature with the tokens min-p, top-k and top-p drop set to -inf."""
    row = row / p.temperature
    if p.min_p > 0.0:  # keep p(token) >= min_p * max p; the top token always stays
        probs = torch.softmax(row, dim=-1)
        row = row.masked_fill(probs < p.min_p * probs.max(), float("-inf"))
    if p.top_k > 0 and p.top_k < row.numel():
        kth = torch.topk(row, p.top_k).values[-1]
        row = row.masked_fill(row < kth, float("-inf"))
    if p.top_p < 1.0:
        sorted_logits, idx = torch.sort(row, descending=True)
        cum = torch.softmax(sorted_logits, dim=-1).cumsum(-1)
        drop = cum - torch.softmax(sorted_logits, dim=-1) >= p.top_p  # keep the smallest prefix reaching top_p
        sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))  # no boolean indexing: no sync
        row = torch.full_like(row, float("-inf")).scatter(0, idx, sorted_logits)
    return row


def _sample_row(row: torch.Tensor, p: SamplingParams, gen: torch.Generator | None) -> torch.Tensor:
    """The drawn token as a one-element device tensor (not read back here)."""
    probs = torch.softmax(filtered_logits(row.float(), p), dim=-1)
    return torch.multinomial(probs, 1, generator=gen)
