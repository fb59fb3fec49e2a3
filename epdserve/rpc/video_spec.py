"""A video's per-request sampling options ↔ the `VideoSpec` message (common.proto).

The scheduler reads them from a client's `Media`, passes them to E and P in `MediaRef`, and
each side turns them back into the options dict `MultimodalProcessor.preprocess_video` takes.
"""
from __future__ import annotations

from google.protobuf.json_format import MessageToJson

from epdserve.rpc import common_pb2

FIELDS = ("fps", "max_frames", "max_pixels")


def video_options_from_proto(spec: common_pb2.VideoSpec) -> dict:
    """The fields a request set (unset ones take the model's defaults)."""
    return {f: getattr(spec, f) for f in FIELDS if spec.HasField(f)}


def video_spec_to_proto(options: dict | None) -> common_pb2.VideoSpec:
    """A `VideoSpec` from an options dict ({"fps": 2.0, "max_frames": 8, ...}); unknown keys are an error."""
    options = dict(options or {})
    unknown = set(options) - set(FIELDS)
    if unknown:
        raise ValueError(f"unknown video option(s) {sorted(unknown)}; known: {', '.join(FIELDS)}")
    return common_pb2.VideoSpec(**options)


def video_timing(spec: common_pb2.VideoSpec) -> str:
    """A video's timing in its prefix-cache identity (`seams/prefix_hash.media_extra`): its sampling
    spec as the request gave it, canonical JSON. The scheduler (routing), P (its cache) and D (the
    KV it imports) all know the spec, where only decoding the video tells its seconds per grid;
    with the key (the bytes) it decides the sampled frames, so the same video sampled otherwise
    never matches."""
    return "video " + MessageToJson(spec, sort_keys=True, indent=None)
