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
"""
from __future__ import annotations

import enum
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from epdserve.engine.sampling_params import SamplingParams
from epdserve.model.processor import MediaInput


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


@dataclass
class DetokState:
    """Incremental detokenization (StopChecker): text[:text_len] is output_token_ids[:read_offset]
    decoded, final; each step decodes from prefix_offset (a little context) to the end."""

    prefix_offset: int = 0
    read_offset: int = 0
    text_len: int = 0


@dataclass
class MediaItem:
    key: str
    input: MediaInput | None  # None when the request referenced a stored key only (or `load_input` has it)
    num_tokens: int
    grid_thw: torch.Tensor
    features: list[torch.Tensor] | None = None
    from_store: bool = False  # features came from the cache / MM Store, encoder skipped
    wait_since: float | None = None  # prefill-only: when this engine started waiting for the feature
    timing: str | None = None  # a video's sampling spec, as the request gave it: its prefix-cache identity
    load_input: Callable[[], MediaInput] | None = None  # bytes kept undecoded: decodes them if a recompute needs them


@dataclass(eq=False)  # identity: `seq in scheduler.running` must not compare every field
class Sequence:
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    media: list[MediaItem] = field(default_factory=list)
    state: RequestState = RequestState.WAITING
    output_token_ids: list[int] = field(default_factory=list)
    output_logprobs: list = field(default_factory=list)  # TokenLogprob per token sampled here (params.logprobs)
    emitted_logprobs: int = 0
    num_computed_tokens: int = 0
    positions: torch.Tensor | None = None  # [3, prompt_len]
    rope_delta: int = 0
    prompt_embeds: torch.Tensor | None = None  # [prompt_len, hidden], built when media is ready
    generator: torch.Generator | None = None
    finish_reason: str | None = None  # stop | length | abort | error
    error: str | None = None
    retryable: bool = False  # the error is the transport's or the step's, not the request's
    text: str = ""
    emitted_text_len: int = 0
    emitted_tokens: int = 0
    detok: DetokState = field(default_factory=DetokState)  # StopChecker's incremental decoding
    arrival: int = 0
    timings: dict[str, float] = field(default_factory=dict)
    feature_target: str | None = None  # encode role: which prefill side gets the "feature stored" event
    kv_transfer: object | None = None  # RemoteDecode / RemotePrefill (seams.kv_connector)
    kv_error: str | None = None  # the KV connector failed this request's transfer
    num_vision_tokens_hint: int = 0  # decode-only: vision tokens in the remote prompt (reporting)
    num_cached_tokens: int = 0  # prompt tokens whose KV came from the prefix cache
    prefix_counted: bool = False  # its first admission is in the scheduler's prefix-cache query/hit totals
    pinned_tokens: int = 0  # a cached prefix whose media were never encoded: kept through preemption
    block_hashes: list = field(default_factory=list)  # prefix-cache keys of full blocks so far (prefix_hash.BlockKey)
    media_spans: list | None = None  # (key, extra, first, end) per media item (engine/prefix_hash.py)
    media_identity: tuple = ()  # decode-only: (key, extra, num_tokens) per media item, for the prefix cache
    grammar: object | None = None  # structured output: its GrammarState (engine/grammar.py)
    cache_salt: str = ""  # the request's cache salt: its first block's parent (prefix_hash.first_parent)
    decode_clock: tuple[float, int] | None = None  # step budget: (when it started decoding here, outputs then)
    prefill_limit: int | None = None  # pipelined prefill: prompt tokens [0, limit) may be computed now (None: all)
    pipeline: object | None = None  # its engine/pipelined_prefill.PipelineState while media are still missing
    group: object | None = None  # n > 1, until the choices fork: its engine/sequence_group.ChoiceGroup
    group_id: str | None = None  # a forked choice (index > 0): the request it belongs to
    choice: int = 0  # which of the request's n choices this sequence is

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
        return sum(m.num_tokens for m in self.media) or self.num_vision_tokens_hint

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
