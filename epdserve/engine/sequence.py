"""One request's state inside an engine: tokens, media, positions, blocks, outputs.

Lifecycle: ENCODING (media features pending) → WAITING (ready to prefill) → RUNNING
(prefill chunks, then decode) → FINISHED. A decode-only engine starts a request at
WAITING_KV (blocks reserved, KV being imported) and moves it to RUNNING when the KV arrived;
a prefill-only engine parks a request at KV_HELD after its first token until its KV is released.
"""
from __future__ import annotations

import enum
from dataclasses import dataclass, field

import torch

from epdserve.engine.sampling_params import SamplingParams
from epdserve.model.processor import MediaInput


class SeqStatus(enum.Enum):
    ENCODING = "encoding"
    WAITING = "waiting"
    WAITING_KV = "waiting_kv"
    RUNNING = "running"
    KV_HELD = "kv_held"
    FINISHED = "finished"


@dataclass
class MediaItem:
    key: str
    input: MediaInput | None  # None when the request referenced a stored key only
    num_tokens: int
    grid_thw: torch.Tensor
    features: list[torch.Tensor] | None = None
    from_store: bool = False  # features came from the cache / MM Store, encoder skipped
    wait_since: float | None = None  # prefill-only: when this engine started waiting for the feature


@dataclass
class Sequence:
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    media: list[MediaItem] = field(default_factory=list)
    status: SeqStatus = SeqStatus.WAITING
    output_token_ids: list[int] = field(default_factory=list)
    num_computed_tokens: int = 0
    positions: torch.Tensor | None = None  # [3, prompt_len]
    rope_delta: int = 0
    prompt_embeds: torch.Tensor | None = None  # [prompt_len, hidden], built when media is ready
    generator: torch.Generator | None = None
    finish_reason: str | None = None
    error: str | None = None
    text: str = ""
    emitted_text_len: int = 0
    emitted_tokens: int = 0
    arrival: int = 0
    timings: dict[str, float] = field(default_factory=dict)
    feature_target: str | None = None  # encode role: which prefill side gets the "feature stored" event

    @property
    def prompt_len(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_tokens(self) -> int:
        return self.prompt_len + len(self.output_token_ids)

    @property
    def in_prefill(self) -> bool:
        """True while prompt tokens (or recomputed outputs after preemption) remain to be computed."""
        return self.num_computed_tokens < self.num_tokens - 1 or not self.output_token_ids

    @property
    def num_vision_tokens(self) -> int:
        return sum(m.num_tokens for m in self.media)

    def token_at(self, i: int) -> int:
        return self.prompt_token_ids[i] if i < self.prompt_len else self.output_token_ids[i - self.prompt_len]

    def position_slice(self, start: int, end: int) -> torch.Tensor:
        """M-RoPE positions [3, end-start] of tokens [start, end): prompt positions, then text positions."""
        parts = []
        if start < self.prompt_len:
            parts.append(self.positions[:, start : min(end, self.prompt_len)])
        if end > self.prompt_len:
            lo = max(start, self.prompt_len)
            parts.append(torch.arange(lo, end).add_(self.rope_delta).expand(3, -1))
        return parts[0] if len(parts) == 1 else torch.cat(parts, dim=1)
