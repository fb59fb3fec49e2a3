"""The request object (issue 47): `Sequence` keeps what the scheduler and the step read, every
other concern lives in one of its typed parts (engine/request_parts.py), and no field is typed
`object` (a TP rank, a reader, a type checker all need to know what a field holds)."""
from __future__ import annotations

import dataclasses
import typing

from epdserve.engine import request_parts, sequence
from epdserve.engine.sampling_params import SamplingParams
from epdserve.engine.sequence import Sequence

PARTS = (Sequence, request_parts.MediaItem, request_parts.Emitted, request_parts.PrefixMemo,
         request_parts.Handoff, request_parts.ChoiceGroup, request_parts.PipelineState, request_parts.DetokState)


def test_every_field_of_a_request_and_its_parts_has_a_concrete_type():
    vague = []
    for cls in PARTS:
        hints = typing.get_type_hints(cls, vars(request_parts) | vars(sequence))
        for f in dataclasses.fields(cls):
            args = typing.get_args(hints[f.name]) or (hints[f.name],)
            if object in args or typing.Any in args:
                vague.append(f"{cls.__name__}.{f.name}")
    assert not vague, f"fields typed object/Any: {vague}"


def test_the_sequence_holds_its_parts_and_no_loose_bookkeeping():
    names = {f.name for f in dataclasses.fields(Sequence)}
    assert {"emitted", "prefix", "handoff"} <= names
    loose = names & {"emitted_tokens", "emitted_text_len", "emitted_logprobs", "detok", "block_hashes", "media_spans",
                     "media_identity", "cache_salt", "prefix_counted", "pinned_tokens", "num_cached_tokens",
                     "kv_transfer", "kv_error", "feature_target", "num_vision_tokens_hint"}
    assert not loose, f"bookkeeping back on the sequence: {sorted(loose)}"
    assert len(names) <= 30, f"{len(names)} fields on Sequence"


def test_each_request_gets_parts_of_its_own():
    parent = Sequence("r", [1, 2, 3], SamplingParams())
    other = Sequence("s", [1], parent.params)
    assert parent.emitted is not other.emitted and parent.prefix is not other.prefix
    assert parent.prefix.block_hashes is not other.prefix.block_hashes
