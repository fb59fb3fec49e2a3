"""Media keys: the one identity of a media item (store, events, routing, prefix caching).

A key is ``"<namespace>:<32 hex>"``: the namespace, then a keyed BLAKE2b-128 (hashlib) of the raw
media bytes under the deployment's media-key secret (`MediaKeySecret`). An unkeyed fast hash
would let anyone build two images with one key (XXH3's secret is public: such pairs take
milliseconds) and have every later sender of the one served the other's features, prefix and
answer; without the secret nobody can compute a key, let alone aim two images at one. The
namespace fingerprints everything that decides what features an image turns into: the model id,
the vision tower (parameter names, shapes, dtypes and a cheap strided sample of the weights) and
the image processor's config. Two models therefore never share features, and a changed processor
(or a re-finetuned tower under the same model id) never serves stale ones. The namespace is no
secret and needs none: nothing an attacker sends reaches it.

Who holds the secret: whoever computes keys that others compare. In a deployment that is the
scheduler alone (it keys every media item it receives; instances take the keys it sends with the
bytes, over the cluster-token-guarded internal port), so `epdserve launch` makes one as it makes
the cluster token and hands it to the scheduler in its environment (`EPDSERVE_MEDIA_KEY_SECRET`),
Kubernetes reads it from the release's Secret, an operator may pass ``--media-key-secret-file``.
A scheduler without one keys with a random secret of its own (logged): safe, but a shared MM
Store's features are then not found again after its restart. One process on its own (the
offline `LLM`, benches) keys with `MediaKeySecret.of_process()`: the environment's, else a random
one made once per process, so that every engine of the process agrees.

Checksums are where xxhash stays (nothing adversarial depends on them): the namespace's
fingerprint of the tower and processor config (our own weights and config, never request
data), the MM Store value's checksum (`transfer/mm_store/codec.py`: corruption, not forgery;
who may write is the server's password). The router's prefix index hashes prompts with the
engines' own SHA-256 block keys (`seams/prefix_hash.py`), not xxhash.

Computing a namespace touches every parameter once but copies only a few values of each, so
it costs milliseconds even for a 600M-parameter tower; compute it once per process.
"""
from __future__ import annotations

import hashlib
import json
import os
import re
import secrets
from pathlib import Path
from typing import TYPE_CHECKING

import xxhash

if TYPE_CHECKING:  # torch only where a namespace is computed: the secret's users (CLI flags, the
    import torch   # scheduler's security options) load without it

MEDIA_KEY_SECRET_ENV = "EPDSERVE_MEDIA_KEY_SECRET"
_SAMPLES_PER_PARAM = 64
_SAFE_NAME = re.compile(r"[^A-Za-z0-9._-]+")
_PERSON = b"epdserve-media"  # BLAKE2b personalisation: these digests are media keys, nothing else
_PROCESS_RANDOM = secrets.token_bytes(32)  # drawn once per process, never changed: `of_process` without a configured secret


class MediaKeySecret:
    """The per-deployment secret media keys are keyed with; never prints.

    Sources (`load`), first found wins: a file (0600, as `launch` writes it), the environment
    variable `EPDSERVE_MEDIA_KEY_SECRET`. Any non-empty text works; the BLAKE2b key is derived
    from it, so processes given the same text compute the same keys."""

    __slots__ = ("_key",)

    def __init__(self, value: str | bytes):
        raw = value.encode() if isinstance(value, str) else bytes(value)
        if not raw.strip():
            raise ValueError("an empty media-key secret")
        self._key = hashlib.blake2b(raw.strip(), digest_size=32, person=b"epdserve-mkey").digest()

    @classmethod
    def random(cls) -> "MediaKeySecret":
        return cls(secrets.token_bytes(32))

    @classmethod
    def load(cls, file: str | Path | None = None, env: str | None = MEDIA_KEY_SECRET_ENV) -> "MediaKeySecret | None":
        """The secret from `file`, else from the environment variable `env`; None where neither is set."""
        if file:
            text = Path(file).read_text()
            if not text.strip():
                raise ValueError(f"{file}: empty media-key secret file")
            return cls(text)
        if env and os.environ.get(env, "").strip():
            return cls(os.environ[env])
        return None

    @classmethod
    def of_process(cls) -> "MediaKeySecret":
        """This process's secret: the environment's, else the random one drawn when this module was
        imported (a constant: every engine of the process agrees)."""
        return cls.load() or cls(_PROCESS_RANDOM)

    def digest(self, raw, salt: str = "") -> str:
        """32 hex: BLAKE2b-128 of `raw`, keyed; with a `salt` (a request's cache salt), of the
        salt's length and bytes, then `raw` (no salt: of `raw` alone, as before salts)."""
        h = hashlib.blake2b(digest_size=16, key=self._key, person=_PERSON)
        if salt:
            s = salt.encode()
            h.update(b"salt:%d:" % len(s) + s)
        h.update(raw)
        return h.hexdigest()

    def __eq__(self, other) -> bool:
        return isinstance(other, MediaKeySecret) and secrets.compare_digest(self._key, other._key)

    __hash__ = None

    def __repr__(self) -> str:
        return "MediaKeySecret(***)"

    __str__ = __repr__


def media_key(raw: bytes, namespace: str, secret: MediaKeySecret, salt: str = "") -> str:
    """The key of one media item: its namespace and the keyed BLAKE2b-128 of its raw (encoded)
    bytes, and of the request's cache `salt` (`security/tenants.py`: the tenant's; one tenant's
    features, and their presence in the MM Store, are never another's). The one function every
    key is computed with (scheduler, engines, benches)."""
    if not isinstance(raw, (bytes, bytearray, memoryview)):
        raise TypeError(f"media_key needs the raw media bytes, got {type(raw).__name__}")
    if not namespace or ":" in namespace:
        raise ValueError(f"namespace must be a non-empty string without ':', got {namespace!r}")
    if not isinstance(secret, MediaKeySecret):
        raise TypeError(f"media_key needs the deployment's MediaKeySecret, got {type(secret).__name__}")
    return f"{namespace}:{secret.digest(raw, salt)}"


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
    import torch

    return sample.view(torch.uint8).numpy().tobytes()


def _config_fingerprint(config: dict) -> bytes:
    # Keys starting with "_" are transformers' bookkeeping (e.g. "_processor_class"), not behaviour.
    public = {k: v for k, v in config.items() if not str(k).startswith("_")}
    return json.dumps(public, sort_keys=True, default=repr).encode()
