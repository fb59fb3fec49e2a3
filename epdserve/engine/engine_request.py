"""`EngineRequest`: what a caller hands `LLMEngine.add_request` — one type for every role."""
from __future__ import annotations

from dataclasses import dataclass, field

from epdserve.engine.sampling_params import SamplingParams
from epdserve.engine.request_parts import MediaItem, TenantShare
from epdserve.seams.kv_connector import RemoteDecode, RemotePrefill


@dataclass
class EngineRequest:
    request_id: str
    prompt_token_ids: list[int]  # placeholders expanded; ignored by an encode-only engine
    media: list[MediaItem] = field(default_factory=list)
    params: SamplingParams = field(default_factory=SamplingParams)
    feature_target: str | None = None  # encode: the prefill side told when features are stored
    kv_transfer: RemoteDecode | RemotePrefill | None = None  # RemoteDecode (prefill role) / RemotePrefill (decode role)
    num_vision_tokens: int = 0  # decode role: vision tokens of the remote prompt (reporting only)
    # decode role: (key, extra, num_tokens) per media item in prompt order (seams/prefix_hash.py
    # `media_extra`): the identity the prefix cache keys the imported KV by; without it a prompt
    # with media is never cached there
    media_identity: tuple = ()
    tenant: TenantShare = field(default_factory=TenantShare)  # whose it is, and its weight (engine/fair_share.py)
    cache_salt: str = ""  # folded into the first KV block's hash (prefix_hash.py): prefixes shared only under one salt
