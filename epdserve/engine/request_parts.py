"""The parts a request's `Sequence` (engine/sequence.py) is made of, each a record of its own, so
that the sequence itself keeps what the scheduler reads and every other concern has one home:

- `MediaItem`: one image or video of the prompt (its key, input, token count, features);
- `Emitted`: how much of the output the engine has streamed (tokens, text, logprobs) and the
  incremental detokenizer's offsets (`DetokState`, engine/stop_checker.py);
- `PrefixMemo`: the prefix cache's view of the request (engine/prefix_hash.py, engine/scheduler.py):
  its cached and pinned tokens, the hashes of its full blocks so far, its media spans and identity,
  its cache salt;
- `Handoff`: what crosses to another stage (the feature target of an encode-only request, the KV
  transfer of a prefill- or decode-only one and its error, the remote prompt's vision tokens);
- `TenantShare`: whose request it is and the tenant's weight (engine/fair_share.py);
- `ChoiceGroup`: the generators of a request's choices 1..n-1 until they fork (engine/sequence_group.py);
- `PipelineState`: where each media item's rows sit in the prompt while a request is prefilled
  before all its media arrived (engine/pipelined_prefill.py).

Nothing here imports the sequence: the records are leaves.
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from epdserve.model.processor import MediaInput
from epdserve.seams.kv_connector import RemoteDecode, RemotePrefill
from epdserve.seams.prefix_hash import BlockKey


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


@dataclass
class DetokState:
    """Incremental detokenization (StopChecker): text[:text_len] is output_token_ids[:read_offset]
    decoded, final; each step decodes from prefix_offset (a little context) to the end."""

    prefix_offset: int = 0
    read_offset: int = 0
    text_len: int = 0


@dataclass
class Emitted:
    """What the request's outputs have carried so far (engine/outputs.py makes each delta from it)."""

    tokens: int = 0
    text_len: int = 0
    logprobs: int = 0
    detok: DetokState = field(default_factory=DetokState)


@dataclass
class PrefixMemo:
    """The prefix cache's view of one request."""

    cache_salt: str = ""  # the request's cache salt: its first block's parent (prefix_hash.first_parent)
    media_identity: tuple = ()  # decode-only: (key, extra, num_tokens) per media item, from the request
    media_spans: list | tuple | None = None  # (key, extra, first, end) per media item; UNHASHABLE: never hashed
    block_hashes: list[BlockKey] = field(default_factory=list)  # keys of its full blocks so far
    cached_tokens: int = 0  # prompt tokens whose KV came from the prefix cache
    counted: bool = False  # its first admission is in the scheduler's prefix-cache query/hit totals
    pinned_tokens: int = 0  # a cached prefix whose media were never encoded: kept through preemption


@dataclass
class Handoff:
    """What crosses between this engine and another stage for the request."""

    feature_target: str | None = None  # encode-only: the prefill side told when its features are stored
    kv_transfer: RemoteDecode | RemotePrefill | None = None  # prefill-only: where its KV goes; decode-only: whence
    kv_error: str | None = None  # the KV connector failed this request's transfer
    vision_tokens: int = 0  # decode-only: vision tokens in the remote prompt (reporting)


@dataclass(frozen=True)
class TenantShare:
    """Whose request it is (the scheduler's tenant name, "" the default tenant) and the tenant's
    weight: its fair share of the engine's slots (engine/fair_share.py)."""

    name: str = ""
    weight: float = 1.0

    def __post_init__(self):
        if not self.weight > 0:
            raise ValueError(f"tenant {self.name!r}: weight must be > 0, got {self.weight}")


def choice_seed(seed: int, j: int) -> int:
    """Choice j's seed: seed + j, wrapped inside int64 (what the fronts sent as n requests)."""
    return (seed + j + 2**63) % 2**64 - 2**63


@dataclass
class ChoiceGroup:
    """A request's choices 1..n-1 before they fork: their generators (None: unseeded)."""

    n: int
    generators: list[torch.Generator | None]

    @classmethod
    def of(cls, seed: int | None, n: int, device) -> ChoiceGroup:
        gens = [None if seed is None else torch.Generator(device=device).manual_seed(choice_seed(seed, j))
                for j in range(1, n)]
        return cls(n, gens)


@dataclass
class PipelineState:
    """A pipelined prefill's map of the prompt: item j's placeholder rows, and the items whose
    features are already written into the prompt embeddings."""

    visual: list[int]  # prompt indices of the visual tokens, in order
    offsets: list[int]  # item j's rows are visual[offsets[j]:offsets[j + 1]]
    filled: set[int] = field(default_factory=set)  # items whose features are in the embeddings

    @classmethod
    def of(cls, prompt_token_ids: list[int], media: list[MediaItem], visual_ids: tuple[int, ...]) -> PipelineState:
        visual = [i for i, t in enumerate(prompt_token_ids) if t in visual_ids]
        offsets = [0]
        for m in media:
            offsets.append(offsets[-1] + m.num_tokens)
        if offsets[-1] != len(visual):
            raise ValueError(f"{len(visual)} visual tokens in the prompt but media for {offsets[-1]}")
        return cls(visual, offsets)

    def rows(self, j: int) -> list[int]:
        return self.visual[self.offsets[j]:self.offsets[j + 1]]
