"""Sampling parameters on the wire: common.SamplingParams ↔ the engine's `SamplingParams`.

The one conversion both sides of the wire use (the scheduler validating a public request, an
instance reading an internal one); it lives in instance/, the lowest layer that has both the
engine's type and the wire (rpc/ imports nothing of the engine). A field the sender left unset
takes the engine's default; bad values raise `InvalidRequestError` (callers map it to
INVALID_ARGUMENT): a number out of its range (`epdserve.rpc.ranges.check_sampling`, the rules
both fronts share) as `RangeError`, naming the field; a structured output that is empty or
malformed (its schema not JSON, an empty choice list) or that does not parse (engine/grammar.py `check`).
"""
from __future__ import annotations

import dataclasses
import json

from epdserve.engine.sampling_params import SamplingParams
from epdserve.engine.structured_output import StructuredOutput
from epdserve.request_errors import InvalidRequestError
from epdserve.rpc import common_pb2
from epdserve.rpc.ranges import check_sampling

# proto3 `optional` scalars: copied only when the sender set them
_OPTIONAL = ("max_tokens", "temperature", "top_p", "top_k", "seed", "ignore_eos", "skip_special_tokens",
             "min_p")
# the logits processors' and log probabilities' (proto fields 40-59)
_OPTIONAL_PROCESSING = ("presence_penalty", "frequency_penalty", "repetition_penalty", "logprobs", "resumed_outputs",
                        "n")


def sampling_from_proto(p: common_pb2.SamplingParams) -> SamplingParams:
    check_sampling(p)
    kw = {name: getattr(p, name) for name in _OPTIONAL + _OPTIONAL_PROCESSING if p.HasField(name)}
    try:
        if p.HasField("structured"):
            kw["structured"] = structured_from_proto(p.structured)
        params = SamplingParams(stop=list(p.stop), stop_token_ids=list(p.stop_token_ids),
                                logit_bias=dict(p.logit_bias), **kw)
    except (ValueError, TypeError) as e:
        raise InvalidRequestError(f"bad sampling parameters: {e}") from None
    if params.structured is not None:
        from epdserve.engine.grammar import check as check_grammar  # xgrammar and torch: only when asked

        check_grammar(params.structured)
    return params


def sampling_to_proto(s: SamplingParams) -> common_pb2.SamplingParams:
    """Every field set (the receiver needs no defaults of its own); `seed` only when given."""
    p = common_pb2.SamplingParams(
        max_tokens=s.max_tokens, temperature=s.temperature, top_p=s.top_p, top_k=s.top_k,
        stop=list(s.stop), stop_token_ids=list(s.stop_token_ids), ignore_eos=s.ignore_eos,
        skip_special_tokens=s.skip_special_tokens, min_p=s.min_p,
    )
    if s.seed is not None:
        p.seed = s.seed
    if s.structured is not None:
        p.structured.CopyFrom(structured_to_proto(s.structured))
    set_processing(p, s)
    return p


def structured_from_proto(m: common_pb2.StructuredOutput) -> StructuredOutput:
    """ValueError when the constraint is empty or malformed (a schema that is not JSON)."""
    which = m.WhichOneof("constraint")
    if which is None:
        raise ValueError("structured is set but holds no constraint")
    if which == "choice":
        c = StructuredOutput.choice(list(m.choice.choices))
    elif which == "json_object":
        c = StructuredOutput("json_object")
    else:
        c = StructuredOutput("json" if which == "json_schema" else which, getattr(m, which))
    return dataclasses.replace(c, replay_prompt_tokens=m.replay_prompt_tokens)


def structured_to_proto(c: StructuredOutput) -> common_pb2.StructuredOutput:
    if c.kind == "choice":
        m = common_pb2.StructuredOutput(choice=common_pb2.ChoiceList(choices=json.loads(c.spec)))
    elif c.kind == "json_object":
        m = common_pb2.StructuredOutput(json_object=True)
    else:
        m = common_pb2.StructuredOutput(**{"json_schema" if c.kind == "json" else c.kind: c.spec})
    m.replay_prompt_tokens = c.replay_prompt_tokens
    return m


def set_processing(p: common_pb2.SamplingParams, s: SamplingParams) -> None:
    """The logits processors', log probabilities' and choices' (n) fields of `s` onto `p` (only those not off)."""
    for name, off in (("presence_penalty", 0.0), ("frequency_penalty", 0.0), ("repetition_penalty", 1.0),
                      ("resumed_outputs", 0), ("n", 1)):
        if getattr(s, name) != off:
            setattr(p, name, getattr(s, name))
    if s.logprobs is not None:
        p.logprobs = s.logprobs
    p.logit_bias.update(s.logit_bias)
