"""Block hashes for the prefix cache: one per full KV block, chained, keyed by media identity.

Block i's hash is xxh3-64 of (block i-1's hash, block i's token ids, and for every media item
whose placeholder tokens fall in the block: its key, grid, seconds per temporal patch, and the
offset and count of its tokens there). Equal hashes mean equal prefixes: the same text with
another image differs from that image's first block on (vLLM keys blocks by the media hash the
same way, `vllm/v1/core/kv_cache_utils.py` `generate_block_hash_extra_keys`). M-RoPE positions
and DeepStack features depend on nothing past the tokens and media of the prefix, so the KV of
a prefix is a function of its hash.

A decode-only engine holds no media, only their identity (`Sequence.media_identity`, from the
request): its imported KV is hashed the same way. A prompt whose placeholder tokens the media
(or identities) do not account for is never hashed, so it can neither serve nor take a prefix.
"""
from __future__ import annotations

import struct
from array import array

import xxhash

from epdserve.engine.sequence import Sequence


class PrefixHasher:
    def __init__(self, block_size: int, visual_token_ids: tuple[int, ...]):
        self.block_size = block_size
        self.visual = frozenset(t for t in visual_token_ids if t is not None)

    def hashes(self, seq: Sequence, num_tokens: int) -> list[int]:
        """Hashes of the full blocks among the request's first `num_tokens` tokens (extends the
        request's memo `seq.block_hashes`)."""
        bs, memo = self.block_size, seq.block_hashes
        n = num_tokens // bs
        if len(memo) >= n:
            return memo[:n]
        spans = seq.media_spans if seq.media_spans is not None else self._media_spans(seq)
        seq.media_spans = spans
        if spans is UNHASHABLE:
            return []
        prev = memo[-1] if memo else 0
        for i in range(len(memo), n):
            lo, hi = i * bs, (i + 1) * bs
            h = xxhash.xxh3_64(struct.pack("<Q", prev))
            h.update(array("q", (seq.token_at(j) for j in range(lo, hi))).tobytes())
            for key, extra, start, end in spans:
                a, b = max(lo, start), min(hi, end)
                if a < b:
                    h.update(f"{key}|{extra}|{a - start}|{b - a};".encode())
            prev = h.intdigest()
            memo.append(prev)
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
