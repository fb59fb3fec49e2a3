"""Block hashes for the prefix cache: one per full KV block, chained, keyed by media identity.

Block i's hash is xxh3-64 of (block i-1's hash, block i's token ids, and for every media item
whose placeholder tokens fall in the block: its key, grid, seconds per temporal patch, and the
offset and count of its tokens there). Equal hashes mean equal prefixes: the same text with
another image differs from that image's first block on (vLLM keys blocks by the media hash the
same way, `vllm/v1/core/kv_cache_utils.py` `generate_block_hash_extra_keys`). M-RoPE positions
and DeepStack features depend on nothing past the tokens and media of the prefix, so the KV of
a prefix is a function of its hash.
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

    def _media_spans(self, seq: Sequence) -> list[tuple[str, str, int, int]]:
        """(key, grid and timing, first token, end) per media item, its placeholder tokens in
        prompt order (a Qwen3-VL video's placeholder runs, text between, count as one span)."""
        positions = [i for i, t in enumerate(seq.prompt_token_ids) if t in self.visual]
        out, r = [], 0
        for m in seq.media:
            mine = positions[r:r + m.num_tokens]
            r += m.num_tokens
            if not mine:
                break
            grid = tuple(int(x) for x in m.grid_thw.reshape(-1).tolist())
            spg = getattr(m.input, "seconds_per_grid", None) if m.input is not None else None
            out.append((m.key, f"{grid}/{spg}", mine[0], mine[-1] + 1))
        return out
