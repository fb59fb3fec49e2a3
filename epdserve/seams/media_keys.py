"""Media keys: the one identity of a media item (store, events, routing, prefix caching).

A key is ``"<namespace>:<xxh3-128 hex of the raw media bytes>"``. The namespace fingerprints
everything that decides what features an image turns into: the model id, the vision tower
(parameter names, shapes, dtypes and a cheap strided sample of the weights) and the image
processor's config. Two models therefore never share features, and a changed processor (or a
re-finetuned tower under the same model id) never serves stale ones.

Computing a namespace touches every parameter once but copies only a few values of each, so
it costs milliseconds even for a 600M-parameter tower; compute it once per process.
"""
from __future__ import annotations

import json
import re

import torch
import xxhash

_SAMPLES_PER_PARAM = 64
_SAFE_NAME = re.compile(r"[^A-Za-z0-9._-]+")


def media_key(raw: bytes, namespace: str) -> str:
    """The key of one media item: its namespace and the xxh3-128 of its raw (encoded) bytes."""
    if not isinstance(raw, (bytes, bytearray, memoryview)):
        raise TypeError(f"media_key needs the raw media bytes, got {type(raw).__name__}")
    if not namespace or ":" in namespace:
        raise ValueError(f"namespace must be a non-empty string without ':', got {namespace!r}")
    return f"{namespace}:{xxhash.xxh3_128_hexdigest(raw)}"


def namespace_for(model_id: str, vision_tower: torch.nn.Module, image_processor_config: dict) -> str:
    """A short, stable namespace: ``"<readable model name>@<16 hex fingerprint>"``.

    The same checkpoint loaded in two processes (E and P) gives the same namespace; a different
    dtype gives a different one on purpose, since its features differ.
    """
    if not isinstance(model_id, str) or not model_id:
        raise ValueError("model_id must be a non-empty string")
    if not isinstance(image_processor_config, dict):
        raise TypeError(
            "image_processor_config must be a dict (e.g. image_processor.to_dict()), "
            f"got {type(image_processor_config).__name__}"
        )
    h = xxhash.xxh3_64()
    h.update(model_id.encode())
    h.update(_tower_fingerprint(vision_tower))
    h.update(_config_fingerprint(image_processor_config))
    name = _SAFE_NAME.sub("-", model_id.rstrip("/").rsplit("/", 1)[-1])[:48] or "model"
    return f"{name}@{h.hexdigest()}"


def _tower_fingerprint(tower: torch.nn.Module) -> bytes:
    h = xxhash.xxh3_64()
    for name, param in tower.named_parameters():
        h.update(f"p {name} {tuple(param.shape)} {param.dtype}\n".encode())
        h.update(_weight_sample(param.detach()))
    for name, buf in tower.named_buffers():
        h.update(f"b {name} {tuple(buf.shape)} {buf.dtype}\n".encode())
    return h.digest()


def _weight_sample(t: torch.Tensor) -> bytes:
    """Up to 64 evenly strided values of ``t`` as bytes (empty for meta tensors)."""
    if t.is_meta or t.numel() == 0:
        return b""
    flat = t.reshape(-1)
    step = max(1, flat.numel() // _SAMPLES_PER_PARAM)
    sample = flat[::step][:_SAMPLES_PER_PARAM].to("cpu").contiguous()
    return sample.view(torch.uint8).numpy().tobytes()


def _config_fingerprint(config: dict) -> bytes:
    # Keys starting with "_" are transformers' bookkeeping (e.g. "_processor_class"), not behaviour.
    public = {k: v for k, v in config.items() if not str(k).startswith("_")}
    return json.dumps(public, sort_keys=True, default=repr).encode()
