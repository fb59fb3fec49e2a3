"""Sampler: the step's tokens from its logits rows — the one owner of everything between the LM
head and a token.

`StepSampler` runs, per step, in this order: the raw log probabilities of the rows that ask
(engine/logprobs.py), logit bias and penalties (engine/logits_process.py), the structured
outputs' grammar mask (engine/grammar.py `TokenMasker`), sampling (`sample`), and for a group at
its first token (n > 1, engine/sequence_group.py) choices 1..n-1 drawn from the same processed
row, each with its own generator. It returns what it drew; it assigns nothing on the requests.

Greedy rows take argmax; sampled rows apply temperature, then min-p, top-k, top-p (vLLM v1's
order: min-p is computed on the temperature-scaled distribution over the whole vocabulary),
then draw with the request's own generator (seeded requests reproduce whatever they are
batched with).
"""
from __future__ import annotations

import torch

from epdserve.engine.grammar import TokenMasker
from epdserve.engine.logits_process import apply_processors
from epdserve.engine.logprobs import TokenLogprob, gather, log_probs
from epdserve.engine.sampling_params import SamplingParams

Choices = tuple[tuple[int, "TokenLogprob | None"], ...]


class StepSampler:
    """One engine's sampling: the grammar bitmask is built at the first grammar, sized for
    `max_rows` rows."""

    def __init__(self, max_rows: int):
        self.max_rows = max_rows
        self.masker: TokenMasker | None = None

    def __call__(self, logits: torch.Tensor, seqs: list) -> tuple[list[int], list[TokenLogprob | None],
                                                                  list[Choices | None]]:
        """`logits` [N, V] fp32, row r is seqs[r]'s (its requests: params, generator, grammar,
        outputs so far). Returns per row: the token, its TokenLogprob (None unless asked), and a
        group's other choices at its first token (None otherwise). `logits` is processed in place."""
        want = [r for r, s in enumerate(seqs) if s.params.logprobs is not None]
        lp = log_probs(logits, want)  # raw: before bias, penalties, the grammar's mask and temperature
        apply_processors(logits, seqs)
        grammars = [(r, s.grammar, s.output_token_ids) for r, s in enumerate(seqs) if s.grammar is not None]
        if grammars:
            if self.masker is None:
                self.masker = TokenMasker(logits.shape[-1], logits.device, rows=self.max_rows)
            self.masker(logits, grammars)
        toks = sample(logits, [s.params for s in seqs], [s.generator for s in seqs])
        logprobs: list[TokenLogprob | None] = [None] * len(seqs)
        if lp is not None:
            for r, entry in zip(want, gather(lp, [toks[r] for r in want], [seqs[r].params.logprobs for r in want])):
                logprobs[r] = entry
        return toks, logprobs, draw_choices(seqs, logits, lp, want)


def draw_choices(seqs: list, logits: torch.Tensor, lp: torch.Tensor | None, want: list[int]) -> list[Choices | None]:
    """Per row of `logits` (processed, masked): for a group at its first token, choices 1..n-1
    drawn from that row with their own generators, as (token, TokenLogprob or None); else None."""
    out: list[Choices | None] = [None] * len(seqs)
    for r, seq in enumerate(seqs):
        g = seq.group
        if g is None or seq.output_token_ids:
            continue
        m = g.n - 1
        toks = sample(logits[r].expand(m, -1), [seq.params] * m, g.generators)
        lps = [None] * m
        if lp is not None and r in want:
            lps = gather(lp[[want.index(r)] * m], toks, [seq.params.logprobs] * m)
        out[r] = tuple(zip(toks, lps))
    return out


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
