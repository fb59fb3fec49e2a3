"""Conversions between the internal protobuf messages and the engine's types (instance side).

- `media_items`: MediaRef list → engine MediaItems (bytes preprocessed here, so a corrupt image
  fails its request before it is queued; bytes marked `in_store` — features stored before, the
  scheduler decoded them already — are decoded only if the engine must recompute them);
- `timings_to_proto`: an engine timings dict → StageTimings;
- `token_delta`: a RequestOutput → TokenDelta (its choice index too); `coalesce`: consecutive outputs of
  one request's choice → one (their new tokens, log probabilities and text joined), so a stream sends one message for
  what queued up;
- `logprobs_to_proto`: an engine `TokenLogprob` → common.TokenLogprobs.
"""
from __future__ import annotations

import dataclasses
import time

import torch

from epdserve.engine.outputs import RequestOutput
from epdserve.engine.request_parts import MediaItem, TenantShare
from epdserve.request_errors import InvalidRequestError
from epdserve.rpc import common_pb2, instance_pb2
from epdserve.rpc.video_spec import video_options_from_proto, video_timing

# engine timing key → StageTimings field
_TIMING_FIELDS = {
    "encode_start": "encode_start",
    "encode_end": "encode_end",
    "prefill_start": "prefill_start",
    "first_token": "first_token",
    "kv_transfer_end": "kv_transfer_end",
    "first_decode": "first_decode",
    "finished": "finished",
}


def media_items(engine, refs, *, wait_for_features: bool = True) -> list[MediaItem]:
    """Engine media items for `refs`; the features of items not expected in the store are
    recomputed at once (no bounded wait) unless `wait_for_features` says otherwise."""
    items = []
    for i, ref in enumerate(refs):
        if not ref.key:
            raise InvalidRequestError(f"media item {i} has no key")
        if ref.data and ref.in_store and not ref.HasField("video") and len(ref.grid_thw) == 3 and ref.num_tokens:
            item = MediaItem(key=ref.key, input=None, num_tokens=int(ref.num_tokens),
                             grid_thw=torch.tensor(list(ref.grid_thw), dtype=torch.long),
                             load_input=_lazy_image(engine, bytes(ref.data), int(ref.num_tokens), i))
            item.wait_since = float("-inf")  # in the store or not: nothing is on its way
        elif ref.data:
            if ref.HasField("video"):  # a video: decoded and sampled as the scheduler did
                m = engine.processor.preprocess_video(bytes(ref.data), video_options_from_proto(ref.video))
            else:
                m = engine.processor.preprocess_image(bytes(ref.data))
            if ref.num_tokens and m.num_tokens != ref.num_tokens:
                raise InvalidRequestError(
                    f"media item {i}: the {m.kind} expands to {m.num_tokens} tokens, the request says {ref.num_tokens}")
            item = engine.media_item(m, key=ref.key)
            if ref.HasField("video"):
                item.timing = video_timing(ref.video)  # its prefix-cache identity, as D and the router know it
        else:
            if len(ref.grid_thw) != 3 or not ref.num_tokens:
                raise InvalidRequestError(f"media item {i} ({ref.key}) has neither bytes nor grid_thw + num_tokens")
            item = MediaItem(key=ref.key, input=None, num_tokens=int(ref.num_tokens),
                             grid_thw=torch.tensor(list(ref.grid_thw), dtype=torch.long))
        if not (ref.expect_features and wait_for_features) and item.input is not None:
            item.wait_since = float("-inf")  # nothing is on its way: recompute without waiting
        items.append(item)
    return items


def _lazy_image(engine, data: bytes, num_tokens: int, i: int):
    """Decode `data` when the engine must recompute the item (its features left the store)."""
    def load():
        m = engine.processor.preprocess_image(data)
        if m.num_tokens != num_tokens:
            raise InvalidRequestError(f"media item {i}: the image expands to {m.num_tokens} tokens, "
                                      f"the request says {num_tokens}")
        return m
    return load


def tenant_share(msg: instance_pb2.TenantShare) -> TenantShare:
    """The engine's record of a request's tenant (an unset weight, or a bad one, reads as 1)."""
    w = msg.weight
    return TenantShare(msg.name, w if w > 0 and w != float("inf") else 1.0)


def timings_to_proto(timings: dict[str, float], **extra: float) -> common_pb2.StageTimings:
    out = common_pb2.StageTimings()
    for key, name in _TIMING_FIELDS.items():
        v = extra.get(key, timings.get(key))
        if v:
            setattr(out, name, float(v))
    return out


def coalesce(outs: list[RequestOutput]) -> RequestOutput:
    """One output standing for `outs` (consecutive, of one request): the last one's state with
    every new token and all new text of them all."""
    if len(outs) == 1:
        return outs[0]
    return dataclasses.replace(outs[-1], new_token_ids=[t for o in outs for t in o.new_token_ids],
                               new_text="".join(o.new_text for o in outs),
                               new_logprobs=[lp for o in outs for lp in o.new_logprobs])


def logprobs_to_proto(lp) -> common_pb2.TokenLogprobs:
    return common_pb2.TokenLogprobs(logprob=lp.logprob, top_token_ids=list(lp.top_ids),
                                    top_logprobs=list(lp.top_logprobs))


def token_delta(out: RequestOutput, request_id: str | None = None, **timing_extra: float) -> instance_pb2.TokenDelta:
    d = instance_pb2.TokenDelta(
        request_id=request_id or out.request_id,
        token_ids=list(out.new_token_ids),
        text=out.new_text,
        finished=out.finished,
        finish_reason=out.finish_reason or "" if out.finished else "",
        num_prompt_tokens=out.num_prompt_tokens,
        num_vision_tokens=out.num_vision_tokens,
        num_cached_vision_tokens=out.num_cached_vision_tokens,
        num_cached_tokens=out.num_cached_tokens,
        logprobs=[logprobs_to_proto(lp) for lp in out.new_logprobs],
        index=out.index,
    )
    if out.finished:
        d.timings.CopyFrom(timings_to_proto(out.timings, finished=time.time(), **timing_extra))
    return d
