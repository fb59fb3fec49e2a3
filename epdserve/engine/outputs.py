"""What an engine step reports per request (deltas while running, totals when finished)."""
from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class RequestOutput:
    request_id: str
    new_token_ids: list[int]
    new_text: str
    token_ids: list[int]
    text: str
    finished: bool
    finish_reason: str | None = None  # stop | length | abort | error | prefill_done
    error: str | None = None
    num_prompt_tokens: int = 0
    num_vision_tokens: int = 0
    num_cached_vision_tokens: int = 0
    rope_delta: int = 0  # M-RoPE delta (text position of token i = i + rope_delta); a D side needs it
    timings: dict[str, float] = field(default_factory=dict)
