"""The one prefix hash: chained keys of a prompt's full KV blocks, media identity folded in.

Used by the engine's prefix cache (`engine/prefix_hash.py` keys its blocks with it,
`engine/block_manager.py` looks them up) and by the router's prefix index
(`scheduler/prompt_chunks.py`, hashing a prompt in blocks of each instance pool's registered
block size), so the router's view of a cache is the cache's own keys, not a second hash that
may drift from it.

Block i's key (`BlockKey`) is its `content` — block i-1's digest (`FIRST_PARENT` for the first),
block i's token ids as int64, and for every media item whose placeholder tokens fall in the
block: its key, `media_extra` (grid and timing), and the offset and count of its tokens there —
and its `digest`, the SHA-256 of that content (vLLM hashes blocks with SHA-256 by default for the
same reason: a fast unkeyed hash lets anyone build a block that collides with a popular prefix,
e.g. a chat template's first block, and have their KV served to everyone who sends it). Equal
digests mean equal prefixes, and the engine's block manager still compares the content on every
hit before it serves a block (`BlockManager.lookup`), so not even a broken hash could serve
another prompt's KV. The same text with another image differs from that image's first block on
(vLLM keys blocks by the media hash the same way, `vllm/v1/core/kv_cache_utils.py`
`generate_block_hash_extra_keys`); media keys are keyed by the deployment's secret
(`seams/media_keys.py`), so no one can aim two images at one.

A media item's identity is (key, extra, number of placeholder tokens); extra is `media_extra`
of its grid and timing: None for an image, for a video its sampling spec as the request gave it
(`rpc/video_spec.video_timing`; the offline engine, which has no spec, its seconds per temporal
patch). A prompt whose placeholder tokens the media do not account for has no spans
(`media_spans` returns None): it is never hashed, so it can neither serve nor take a prefix.
Pure functions, no state: safe in any thread.
"""
from __future__ import annotations

import hashlib
from array import array
from collections.abc import Iterable, Sequence
from typing import NamedTuple


class BlockKey(NamedTuple):
    """One full block's identity: `digest` (SHA-256 of `content`) names the whole prefix up to and
    including the block; `content` is exactly what was hashed (the previous block's digest, the
    block's token ids as int64, its media identity), compared on every cache hit."""
    digest: bytes
    content: bytes


class MediaSpan(NamedTuple):
    """One media item's placeholder tokens in a prompt: [start, end) (a Qwen3-VL video's
    placeholder runs, text between, count as one span), and its identity."""
    key: str
    extra: str
    start: int
    end: int


FIRST_PARENT = bytes(32)  # the first block's "previous digest": every content starts with 32 bytes of one


def first_parent(salt: str = "") -> bytes:
    """The first block's parent digest under a request's cache `salt` (its tenant's and its own
    `cache_salt`, security/tenants.py; none: `FIRST_PARENT`): every block of a salted prompt
    differs from every block of another salt (vLLM folds `cache_salt` into the first block)."""
    return hashlib.sha256(b"epdserve-cache-salt\0" + salt.encode()).digest() if salt else FIRST_PARENT


def block_key(prev_digest: bytes, token_ids: bytes, media: bytes = b"") -> BlockKey:
    """The key of a block after the block whose digest is `prev_digest` (`FIRST_PARENT` for the
    first): contents are parent (32 bytes) | token ids (8 bytes each) | media identity, so a
    first block's content is never a later block's."""
    if len(prev_digest) != 32:
        raise ValueError("prev_digest must be a 32-byte digest")
    content = prev_digest + token_ids + media
    return BlockKey(hashlib.sha256(content).digest(), content)


def media_extra(grid_thw, timing=None) -> str:
    """The identity of one media item beside its key: its grid and (video) timing."""
    return f"{tuple(int(x) for x in grid_thw)}/{timing}"


def media_spans(token_ids: Sequence[int], visual: frozenset[int],
                identities: Iterable[tuple[str, str, int]]) -> list[MediaSpan] | None:
    """The span of each media item, `identities` being (key, extra, num_tokens) per item in
    prompt order; None when the items do not account for every placeholder token (`visual`:
    the placeholder token ids) — such a prompt is never hashed."""
    ids = list(identities)
    positions = [i for i, t in enumerate(token_ids) if t in visual]
    if sum(n for _, _, n in ids) != len(positions):
        return None
    out, r = [], 0
    for key, extra, n in ids:
        mine = positions[r:r + n]
        r += n
        if mine:
            out.append(MediaSpan(key, extra, mine[0], mine[-1] + 1))
    return out


def chain(token_ids: Sequence[int], spans: Sequence[MediaSpan], block_size: int, *,
          first_block: int = 0, prev: bytes = FIRST_PARENT) -> list[BlockKey]:
    """Keys of the full blocks in `token_ids`, the tokens from block `first_block`'s first one
    on (0: the whole prompt), chained from `prev` (the digest of block `first_block` - 1);
    `spans` in prompt positions."""
    if block_size < 1:
        raise ValueError("block_size must be >= 1")
    bs, first = block_size, first_block * block_size
    n = len(token_ids) // bs
    raw, width = array("q", token_ids[:n * bs]).tobytes(), 8 * bs  # converted at once
    out, s = [], 0
    for j in range(n):
        lo, hi = first + j * bs, first + (j + 1) * bs
        while s < len(spans) and spans[s].end <= lo:  # spans wholly before this block
            s += 1
        media = b""
        for key, extra, start, end in spans[s:]:
            if start >= hi:
                break
            a, b = max(lo, start), min(hi, end)
            media += f"{key}|{extra}|{a - start}|{b - a};".encode()
        k = block_key(prev, raw[j * width:(j + 1) * width], media)
        prev = k.digest
        out.append(k)
    return out


def prompt_keys(token_ids: Sequence[int], identities: Iterable[tuple[str, str, int]], visual: frozenset[int],
                block_size: int, salt: str = "") -> list[BlockKey]:
    """Keys of the full blocks of a prompt whose media are `identities` ((key, extra,
    num_tokens) in prompt order), under the request's cache `salt`; [] when the media do not
    account for its placeholders."""
    spans = media_spans(token_ids, visual, identities)
    return [] if spans is None else chain(token_ids, spans, block_size, prev=first_parent(salt))
