"""`PrefixHasher`: the prefix-cache keys of a request's full KV blocks, as the engine memoizes them.

The hash itself is `seams/prefix_hash.py` (SHA-256 chained over token ids and media identity;
the router's prefix index hashes prompts with the same functions): this module only says where
a request's media identity comes from and extends a request's memo (`Sequence.prefix.block_hashes`)
as it grows. A media item's identity is its key and `media_extra` of its grid and timing: the
video spec the request carried (`MediaItem.timing`, set by the instance from the request), else
(the offline engine) its seconds per temporal patch. A decode-only engine holds no media, only
their identity (`Sequence.prefix.media_identity`, from the request): its imported KV is hashed the same
way. M-RoPE positions and DeepStack features depend on nothing past the tokens and media of the
prefix, so the KV of a prefix is a function of its key; the block manager compares a hit's
content before serving it (`BlockManager.lookup`).

A request's cache salt (its tenant's and its own `cache_salt`, vLLM's field;
`security/tenants.py`) is folded into its first block: that block's parent is the salt's
SHA-256 (`seams/prefix_hash.first_parent`) instead of `FIRST_PARENT`, so one tenant's prefix is
never a hit, nor a `cached_tokens` count, for another.
"""
from __future__ import annotations

from epdserve.engine.sequence import Sequence
from epdserve.seams.prefix_hash import FIRST_PARENT, BlockKey, block_key, chain, first_parent, media_extra, media_spans

__all__ = ["FIRST_PARENT", "BlockKey", "PrefixHasher", "UNHASHABLE", "block_key", "media_extra", "media_identity"]

UNHASHABLE = ("unhashable",)  # a request's media_spans when its blocks must never be hashed (compared by identity)


def media_identity(seq: Sequence) -> list[tuple[str, str, int]]:
    """(key, extra, num_tokens) per media item of `seq` in prompt order (`seams/prefix_hash.py`)."""
    if not seq.media:
        return list(seq.prefix.media_identity)
    out = []
    for m in seq.media:
        timing = m.timing if m.timing is not None else (
            getattr(m.input, "seconds_per_grid", None) if m.input is not None else None)
        out.append((m.key, media_extra(m.grid_thw.reshape(-1).tolist(), timing), m.num_tokens))
    return out


class PrefixHasher:
    def __init__(self, block_size: int, visual_token_ids: tuple[int, ...]):
        self.block_size = block_size
        self.visual = frozenset(t for t in visual_token_ids if t is not None)

    def hashes(self, seq: Sequence, num_tokens: int) -> list[BlockKey]:
        """Keys of the full blocks among the request's first `num_tokens` tokens (extends the
        request's memo `seq.prefix.block_hashes`)."""
        bs, memo = self.block_size, seq.prefix.block_hashes
        n = num_tokens // bs
        if len(memo) >= n:
            return memo[:n]
        if seq.prefix.media_spans is None:
            spans = media_spans(seq.prompt_token_ids, self.visual, media_identity(seq))
            seq.prefix.media_spans = UNHASHABLE if spans is None else spans
        if seq.prefix.media_spans is UNHASHABLE:
            return []
        first, p = len(memo) * bs, seq.prompt_len
        ids = seq.prompt_token_ids[first:n * bs] + seq.output_token_ids[max(0, first - p):max(0, n * bs - p)]
        memo += chain(ids, seq.prefix.media_spans, bs, first_block=len(memo), prev=memo[-1].digest if memo else first_parent(seq.prefix.cache_salt))
        return memo[:n]
