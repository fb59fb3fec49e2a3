"""OpenAI's `logprobs` objects, from the scheduler's `TokenLogprobs` (one per output token).

Chat (``choices[i].logprobs``): ``{"content": [{"token", "logprob", "bytes", "top_logprobs":
[{"token", "logprob", "bytes"}, ...]}, ...]}``. Completions: ``{"tokens", "token_logprobs",
"top_logprobs": [{token: logprob, ...}, ...], "text_offset"}``, offsets counted over the tokens'
strings from the start of the choice's text (a stream continues each choice's count). A token's
string is its id decoded alone (as vLLM shows it). The values are raw log probabilities: the
model's, before logit bias, penalties and temperature (vLLM's default `raw_logprobs`).
"""
from __future__ import annotations


class LogprobsFormat:
    def __init__(self, tokenizer, chat: bool):
        self.tokenizer, self.chat = tokenizer, chat
        self._offsets: dict[int, int] = {}  # completions: text offset so far, per choice index

    def _tok(self, token_id: int) -> str:
        return self.tokenizer.decode([token_id])

    def build(self, token_ids, logprobs, index: int = 0) -> dict:
        """The `logprobs` object of `token_ids` (their TokenLogprobs, one each)."""
        if self.chat:
            return {"content": [self._chat_entry(t, lp) for t, lp in zip(token_ids, logprobs)]}
        tokens = [self._tok(t) for t in token_ids]
        offsets, at = [], self._offsets.get(index, 0)
        for s in tokens:
            offsets.append(at)
            at += len(s)
        self._offsets[index] = at
        return {"tokens": tokens, "token_logprobs": [lp.logprob for lp in logprobs],
                "top_logprobs": [{self._tok(i): v for i, v in zip(lp.top_token_ids, lp.top_logprobs)}
                                 for lp in logprobs],
                "text_offset": offsets}

    def _chat_entry(self, token_id: int, lp) -> dict:
        s = self._tok(token_id)
        return {"token": s, "logprob": lp.logprob, "bytes": list(s.encode()),
                "top_logprobs": [{"token": (u := self._tok(i)), "logprob": v, "bytes": list(u.encode())}
                                 for i, v in zip(lp.top_token_ids, lp.top_logprobs)]}
