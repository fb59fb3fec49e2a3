"""Log probabilities of sampled tokens (OpenAI's `logprobs` / `top_logprobs`).

Computed from the model's raw logits of the step that sampled the token (fp32 log_softmax over
the whole vocabulary), before logit bias, penalties, temperature and the top-k/top-p/min-p
filters: vLLM's default `logprobs_mode="raw_logprobs"` (the values transformers' `generate`
returns as `output_logits`). Only the rows that ask pay: one log_softmax, one gather, one
top-k, read back together.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class TokenLogprob:
    """One output token's: its own log probability and the `k` most likely tokens' (descending)."""

    logprob: float
    top_ids: tuple[int, ...] = ()
    top_logprobs: tuple[float, ...] = ()


def log_probs(logits: torch.Tensor, rows: list[int]) -> torch.Tensor | None:
    """log_softmax of `rows` of the raw logits [N, V] (a copy: later processing leaves it), or None."""
    if not rows:
        return None
    return torch.log_softmax(logits[torch.tensor(rows, device=logits.device)].float(), dim=-1)


def gather(lp: torch.Tensor, tokens: list[int], ks: list[int]) -> list[TokenLogprob]:
    """Per row of `lp` [R, V]: the log probability of tokens[r] and its top ks[r] alternatives."""
    dev = lp.device
    own = lp.gather(1, torch.tensor(tokens, device=dev).unsqueeze(1)).squeeze(1).tolist()
    k_max = max(ks)
    top_v, top_i = (lp.topk(k_max, dim=-1) if k_max else (lp[:, :0], lp[:, :0].long()))
    top_v, top_i = top_v.tolist(), top_i.tolist()
    return [TokenLogprob(own[r], tuple(top_i[r][:ks[r]]), tuple(top_v[r][:ks[r]])) for r in range(len(tokens))]
