"""What an engine step reports per request (deltas while running, totals when done here).

Making an output costs the same at any output length: nothing in it copies the whole output
while the request runs (`token_ids` is then an `OutputTokens` view; a plain list once done).
"""
from __future__ import annotations

import itertools
from collections.abc import Sequence as SequenceABC
from dataclasses import dataclass, field

from epdserve.engine.sequence import Sequence
from epdserve.engine.stop_checker import StopChecker


@dataclass
class RequestOutput:
    request_id: str
    new_token_ids: list[int]
    new_text: str
    token_ids: SequenceABC[int]  # all output tokens so far: a list once finished, else an OutputTokens view
    text: str
    finished: bool  # no more outputs from this engine (ended, or handed to the next stage)
    finish_reason: str | None = None  # stop | length | abort | error; None while running or handed off
    error: str | None = None
    retryable: bool = False  # with error: a transport or step failure; another instance may succeed
    num_prompt_tokens: int = 0
    num_vision_tokens: int = 0
    num_cached_vision_tokens: int = 0
    num_cached_tokens: int = 0  # prompt tokens whose KV came from the prefix cache
    encoded_keys: list[str] = field(default_factory=list)  # media this engine ran its vision encoder for
    rope_delta: int = 0  # M-RoPE delta (text position of token i = i + rope_delta); a D side needs it
    timings: dict[str, float] = field(default_factory=dict)
    # TokenLogprob (engine/logprobs.py) of the new tokens sampled by this engine, when asked (a
    # decode side's first output token is P's: its log probabilities came with P's answer)
    new_logprobs: list = field(default_factory=list)
    index: int = 0  # which of the request's n choices (SamplingParams.n) these tokens belong to

    @classmethod
    def failed(cls, request_id: str, message: str) -> "RequestOutput":
        """A request rejected before it was queued."""
        return cls(request_id, [], "", [], "", True, finish_reason="error", error=message)


class OutputTokens(SequenceABC):
    """The first `n` ids of a request's output list, read in place (no copy per step).

    Valid because the engine only appends to `Sequence.output_token_ids` (preemption keeps it;
    a decode side sets it once, before any view exists). Compares equal to a list of the ids.
    """

    __slots__ = ("_ids", "_n")

    def __init__(self, ids: list[int], n: int):
        self._ids, self._n = ids, n

    def __len__(self) -> int:
        return self._n

    def __getitem__(self, i):
        if isinstance(i, slice):
            return self._ids[: self._n][i]
        if not -self._n <= i < self._n:
            raise IndexError("output token index out of range")
        return self._ids[i % self._n]

    def __iter__(self):
        return itertools.islice(self._ids, self._n)

    def __eq__(self, other) -> bool:
        if isinstance(other, (list, tuple, OutputTokens)):
            return len(other) == self._n and all(a == b for a, b in zip(self, other))
        return NotImplemented

    __hash__ = None

    def __repr__(self) -> str:
        return repr(list(self))


def make_output(seq: Sequence) -> RequestOutput:
    """The request's output since the last one (tokens and text not yet emitted)."""
    ids, done = seq.output_token_ids, seq.state.done
    new = ids[seq.emitted.tokens :]
    seq.emitted.tokens = len(ids)
    return RequestOutput(
        request_id=seq.output_id,
        new_token_ids=new,
        new_text=StopChecker.text_delta(seq),
        token_ids=list(ids) if done else OutputTokens(ids, len(ids)),
        text=seq.text,
        finished=done,
        finish_reason=seq.finish_reason,
        error=seq.error,
        retryable=seq.retryable,
        num_prompt_tokens=seq.prompt_len,
        num_vision_tokens=seq.num_vision_tokens,
        num_cached_vision_tokens=sum(m.num_tokens for m in seq.media if m.from_store),
        num_cached_tokens=seq.prefix.cached_tokens,
        encoded_keys=[m.key for m in seq.media if m.features is not None and not m.from_store],
        rope_delta=seq.rope_delta,
        timings=dict(seq.timings),
        new_logprobs=_new_logprobs(seq),
        index=seq.choice,
    )


def _new_logprobs(seq: Sequence) -> list:
    new = seq.output_logprobs[seq.emitted.logprobs :]
    seq.emitted.logprobs = len(seq.output_logprobs)
    return new
