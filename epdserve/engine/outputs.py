"""What an engine step reports per request (deltas while running, totals when done here)."""
from __future__ import annotations

from dataclasses import dataclass, field

from epdserve.engine.sequence import Sequence
from epdserve.engine.stop_checker import StopChecker


@dataclass
class RequestOutput:
    request_id: str
    new_token_ids: list[int]
    new_text: str
    token_ids: list[int]
    text: str
    finished: bool  # no more outputs from this engine (ended, or handed to the next stage)
    finish_reason: str | None = None  # stop | length | abort | error; None while running or handed off
    error: str | None = None
    retryable: bool = False  # with error: a transport or step failure; another instance may succeed
    num_prompt_tokens: int = 0
    num_vision_tokens: int = 0
    num_cached_vision_tokens: int = 0
    encoded_keys: list[str] = field(default_factory=list)  # media this engine ran its vision encoder for
    rope_delta: int = 0  # M-RoPE delta (text position of token i = i + rope_delta); a D side needs it
    timings: dict[str, float] = field(default_factory=dict)

    @classmethod
    def failed(cls, request_id: str, message: str) -> "RequestOutput":
        """A request rejected before it was queued."""
        return cls(request_id, [], "", [], "", True, finish_reason="error", error=message)


def make_output(seq: Sequence) -> RequestOutput:
    """The request's output since the last one (tokens and text not yet emitted)."""
    new = seq.output_token_ids[seq.emitted_tokens :]
    seq.emitted_tokens = len(seq.output_token_ids)
    return RequestOutput(
        request_id=seq.request_id,
        new_token_ids=new,
        new_text=StopChecker.text_delta(seq),
        token_ids=list(seq.output_token_ids),
        text=seq.text,
        finished=seq.state.done,
        finish_reason=seq.finish_reason,
        error=seq.error,
        retryable=seq.retryable,
        num_prompt_tokens=seq.prompt_len,
        num_vision_tokens=seq.num_vision_tokens,
        num_cached_vision_tokens=sum(m.num_tokens for m in seq.media if m.from_store),
        encoded_keys=[m.key for m in seq.media if m.features is not None and not m.from_store],
        rope_delta=seq.rope_delta,
        timings=dict(seq.timings),
    )
