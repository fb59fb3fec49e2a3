"""Block keys for the prefix cache: one per full KV block, chained, carrying media identity.

Block i's key (`BlockKey`) is its `content` — block i-1's digest, block i's token ids, and for
every media item whose placeholder tokens fall in the block: its key, grid, seconds per temporal
patch, and the offset and count of its tokens there — and its `digest`, the SHA-256 of that
content (vLLM hashes blocks with SHA-256 by default for the same reason: a fast unkeyed hash
lets anyone build a block that collides with a popular prefix, e.g. a chat template's first
block, and have their KV served to everyone who sends it). Equal digests mean equal prefixes,
and the block manager still compares the content on every hit before it serves a block
(`BlockManager.lookup`), so not even a broken hash could serve another prompt's KV. The same text
with another image differs from that image's first block on (vLLM keys blocks by the media hash
the same way, `vllm/v1/core/kv_cache_utils.py` `generate_block_hash_extra_keys`); media keys are
keyed by the deployment's secret (`seams/media_keys.py`), so no one can aim two images at one.
M-RoPE positions and DeepStack features depend on nothing past the tokens and media of the
prefix, so the KV of a prefix is a function of its key.

A request's cache salt (its tenant's and its own `cache_salt`, vLLM's field;
`security/tenants.py`) is folded into its first block: that block's parent is the salt's
SHA-256 (`first_parent`) instead of `FIRST_PARENT`, so every block of a salted request differs
from every block of another salt (vLLM folds `cache_salt` into the first block's extra keys the
same way) and one tenant's prefix is never a hit, nor a `cached_tokens` count, for another.

A decode-only engine holds no media, only their identity (`Sequence.media_identity`, from the
request): its imported KV is hashed the same way. A prompt whose placeholder tokens the media
(or identities) do not account for is never hashed, so it can neither serve nor take a prefix.
"""
from __future__ import annotations

import hashlib
from array import array
from typing import NamedTuple

from epdserve.engine.sequence import Sequence


class BlockKey(NamedTuple):
    """One full block's identity: `digest` (SHA-256 of `content`) names the whole prefix up to and
    including the block; `content` is exactly what was hashed (the previous block's digest, the
    block's token ids as int64, its media identity), compared on every cache hit."""
    digest: bytes
    content: bytes


FIRST_PARENT = bytes(32)  # the first block's "previous digest": every content starts with 32 bytes of one


def first_parent(salt: str = "") -> bytes:
    """The first block's parent digest under a request's cache `salt` (none: `FIRST_PARENT`)."""
    return hashlib.sha256(b"epdserve-cache-salt\0" + salt.encode()).digest() if salt else FIRST_PARENT


def block_key(prev_digest: bytes, token_ids: bytes, media: bytes = b"") -> BlockKey:
    """The key of a block after the block whose digest is `prev_digest` (`FIRST_PARENT` for the
    first): contents are parent (32 bytes) | token ids (8 bytes each) | media identity, so a
    first block's content is never a later block's."""
    if len(prev_digest) != 32:
        raise ValueError("prev_digest must be a 32-byte digest")
    content = prev_digest + token_ids + media
    return BlockKey(hashlib.sha256(content).digest(), content)


class PrefixHasher:
    def __init__(self, block_size: int, visual_token_ids: tuple[int, ...]):
        self.block_size = block_size
        self.visual = frozenset(t for t in visual_token_ids if t is not None)

    def hashes(self, seq: Sequence, num_tokens: int) -> list[BlockKey]:
        """Keys of the full blocks among the request's first `num_tokens` tokens (extends the
        request's memo `seq.block_hashes`)."""
        bs, memo = self.block_size, seq.block_hashes
        n = num_tokens // bs
        if len(memo) >= n:
            return memo[:n]
        spans = seq.media_spans if seq.media_spans is not None else self._media_spans(seq)
        seq.media_spans = spans
        if spans is UNHASHABLE:
            return []
        prev = memo[-1].digest if memo else first_parent(seq.cache_salt)
        first, p = len(memo) * bs, seq.prompt_len
        ids = seq.prompt_token_ids[first:n * bs] + seq.output_token_ids[max(0, first - p):max(0, n * bs - p)]
        raw, width = array("q", ids).tobytes(), 8 * bs  # the new blocks' token ids, converted at once
        for i in range(len(memo), n):
            lo, hi = i * bs, (i + 1) * bs
            media = b""
            for key, extra, start, end in spans:
                a, b = max(lo, start), min(hi, end)
                if a < b:
                    media += f"{key}|{extra}|{a - start}|{b - a};".encode()
            off = (lo - first) * 8
            k = block_key(prev, raw[off:off + width], media)
            prev = k.digest
            memo.append(k)
        return memo[:n]

    def _media_spans(self, seq: Sequence) -> list[tuple[str, str, int, int]] | tuple:
        """(key, grid and timing, first token, end) per media item, its placeholder tokens in
        prompt order (a Qwen3-VL video's placeholder runs, text between, count as one span);
        UNHASHABLE when the media do not account for every placeholder token."""
        ids = [(m.key, media_extra(m.grid_thw.reshape(-1).tolist(),
                                   getattr(m.input, "seconds_per_grid", None) if m.input is not None else None),
                m.num_tokens) for m in seq.media] or list(seq.media_identity)
        positions = [i for i, t in enumerate(seq.prompt_token_ids) if t in self.visual]
        if sum(n for _, _, n in ids) != len(positions):
            return UNHASHABLE
        out, r = [], 0
        for key, extra, n in ids:
            mine = positions[r:r + n]
            r += n
            if mine:
                out.append((key, extra, mine[0], mine[-1] + 1))
        return out


UNHASHABLE = ("unhashable",)  # a request's media_spans when its blocks must never be hashed (compared by identity)


def media_extra(grid_thw, seconds_per_grid=None) -> str:
    """The identity of one media item beside its key: its grid and (video) timing."""
    return f"{tuple(int(x) for x in grid_thw)}/{seconds_per_grid}"
