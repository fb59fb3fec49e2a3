"""Logits processors: `logit_bias` and the repetition, frequency and presence penalties.

Applied to the fp32 logits of the rows that sample, before temperature and the filters (so
greedy output changes too), in vLLM v1's order (vllm/v1/sample/sampler.py: logit bias, then
`apply_all_penalties`): bias added; repetition penalty over every token of the prompt and the
output (a positive logit divided by it, a negative one multiplied, as transformers'
`RepetitionPenaltyLogitsProcessor`); then ``logit -= frequency * count + presence * (count > 0)``
over the output tokens only (OpenAI's definition). "Output" is what this request generated, on
whichever instance: a decode side holds P's first token as its first output, and a resumed or
retried request's last `resumed_outputs` prompt tokens count as output.

Only rows whose params ask for one of these pay anything: their token ids are uploaded each
step (a list the size of the sequence; fine at the lengths served here).
"""
from __future__ import annotations

import torch

from epdserve.engine.sequence import Sequence


def history(seq: Sequence) -> tuple[list[int], list[int]]:
    """(prompt tokens, output tokens) as the penalties count them."""
    cut = seq.prompt_len - min(seq.params.resumed_outputs, seq.prompt_len)
    return seq.prompt_token_ids[:cut], seq.prompt_token_ids[cut:] + seq.output_token_ids


def apply_processors(logits: torch.Tensor, seqs: list[Sequence]) -> torch.Tensor:
    """`logits` [N, V] (row i is seqs[i]'s) with each row's bias and penalties applied (in place)."""
    for i, seq in enumerate(seqs):
        if seq.params.processes_logits:
            prompt, output = history(seq)
            process_row(logits[i], seq.params, prompt, output)
    return logits


def process_row(row: torch.Tensor, p, prompt: list[int], output: list[int]) -> None:
    """One row [V], in place."""
    vocab, dev = row.shape[0], row.device
    if p.logit_bias:
        ids = [t for t in p.logit_bias if t < vocab]
        if ids:
            row.index_add_(0, torch.tensor(ids, device=dev),
                           torch.tensor([p.logit_bias[t] for t in ids], dtype=row.dtype, device=dev))
    if p.repetition_penalty != 1.0 and (prompt or output):
        seen = torch.zeros(vocab, dtype=torch.bool, device=dev)
        seen[torch.tensor(prompt + output, dtype=torch.long, device=dev).clamp_(max=vocab - 1)] = True
        scaled = torch.where(row > 0, row / p.repetition_penalty, row * p.repetition_penalty)
        row.copy_(torch.where(seen, scaled, row))
    if (p.frequency_penalty or p.presence_penalty) and output:
        ids = torch.tensor(output, dtype=torch.long, device=dev).clamp_(max=vocab - 1)
        counts = torch.zeros(vocab, dtype=row.dtype, device=dev).index_add_(  # plain ops on every device
            0, ids, torch.ones(ids.shape[0], dtype=row.dtype, device=dev))
        row.sub_(p.frequency_penalty * counts + p.presence_penalty * (counts > 0).to(row.dtype))
