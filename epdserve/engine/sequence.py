"""One request's state inside an engine: tokens, media, positions, life-cycle state, outputs.

Life cycle (`RequestState`), by role:
    WAITING_FOR_FEATURES → WAITING → RUNNING → FINISHED                 coupled (PD / EPD)
    WAITING_FOR_FEATURES → HANDED_OFF                                   encode-only (features stored)
    WAITING_FOR_FEATURES → WAITING → RUNNING → [KV_HELD →] HANDED_OFF   prefill-only (first token out,
                                                                        KV sent to the decode side)
    WAITING_FOR_REMOTE_KV → RUNNING → FINISHED                          decode-only (prompt KV imported)
A running request may go back to WAITING (preempted; recomputed later). KV_HELD: this engine is
done computing but its KV connector still reads (or writes) the request's blocks; they are
freed when the connector reports the transfer finished. `finish_reason` says why a request
ended (stop, length, abort, error); it stays None for a request handed to the next stage.

The sequence keeps what the scheduler and the step read; the rest lives in its parts
(engine/request_parts.py): `emitted` (what its outputs carried), `prefix` (the prefix cache's
view), `handoff` (what crosses to another stage).
"""
from __future__ import annotations

import enum
from dataclasses import dataclass, field

import torch

from epdserve.engine.grammar import GrammarState
from epdserve.engine.request_parts import ChoiceGroup, Emitted, Handoff, MediaItem, PipelineState, PrefixMemo, TenantShare
from epdserve.engine.sampling_params import SamplingParams


class RequestState(enum.Enum):
    WAITING_FOR_FEATURES = "waiting_for_features"
    WAITING_FOR_REMOTE_KV = "waiting_for_remote_kv"
    WAITING = "waiting"
    RUNNING = "running"
    KV_HELD = "kv_held"
    HANDED_OFF = "handed_off"
    FINISHED = "finished"

    @property
    def done(self) -> bool:
        """No more outputs come from this engine for the request."""
        return self in (RequestState.KV_HELD, RequestState.HANDED_OFF, RequestState.FINISHED)


@dataclass(eq=False)  # identity: `seq in scheduler.running` must not compare every field
class Sequence:
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    media: list[MediaItem] = field(default_factory=list)
    state: RequestState = RequestState.WAITING
    output_token_ids: list[int] = field(default_factory=list)
    output_logprobs: list = field(default_factory=list)  # TokenLogprob per token sampled here (params.logprobs)
    text: str = ""  # the output's text so far (engine/stop_checker.py)
    num_computed_tokens: int = 0
    positions: torch.Tensor | None = None  # [3, prompt_len]
    rope_delta: int = 0
    prompt_embeds: torch.Tensor | None = None  # [prompt_len, hidden], built when media is ready
    generator: torch.Generator | None = None
    finish_reason: str | None = None  # stop | length | abort | error
    error: str | None = None
    retryable: bool = False  # the error is the transport's or the step's, not the request's
    arrival: int = 0
    tenant: TenantShare = TenantShare()  # whose it is: its fair share of this engine (engine/fair_share.py)
    timings: dict[str, float] = field(default_factory=dict)
    decode_clock: tuple[float, int] | None = None  # step budget: (when it started decoding here, outputs then)
    prefill_limit: int | None = None  # pipelined prefill: prompt tokens [0, limit) may be computed now (None: all)
    pipeline: PipelineState | None = None  # while media are still missing (engine/pipelined_prefill.py)
    grammar: GrammarState | None = None  # structured output (engine/grammar.py)
    group: ChoiceGroup | None = None  # n > 1, until the choices fork (engine/sequence_group.py)
    group_id: str | None = None  # a forked choice (index > 0): the request it belongs to
    choice: int = 0  # which of the request's n choices this sequence is
    emitted: Emitted = field(default_factory=Emitted)  # what its outputs carried so far
    prefix: PrefixMemo = field(default_factory=PrefixMemo)  # the prefix cache's view of it
    handoff: Handoff = field(default_factory=Handoff)  # what crosses to or from another stage

    @property
    def output_id(self) -> str:
        """The request id its outputs carry (a forked choice's internal id is `<id>-c<j>`)."""
        return self.group_id or self.request_id

    @property
    def width(self) -> int:
        """Running sequences it will be once its choices fork (1 once they have)."""
        return self.group.n if self.group is not None else 1

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
        return sum(m.num_tokens for m in self.media) or self.handoff.vision_tokens

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
