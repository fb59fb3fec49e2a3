"""Prompt chunk hashes: what cache-aware routing (`prefix_index.py`, `routing.py`) knows of a prompt.

The scheduler tokenizes every request (`preprocess.py`), so it hashes the expanded token ids
the engines will prefill: in chunks of `CHUNK_TOKENS` (the engines' KV block size on CPU and
CUDA, so a chunk lines up with a block of the engine prefix cache), each hash chained from the
previous one (equal hashes mean equal prefixes), and folded into it the identity (MM Store key,
grid, kind, and the offset and count of its placeholder tokens there) of every media item whose
placeholder tokens fall in the chunk, as `engine/prefix_hash.py` does for blocks: the same text
with another image stops matching at that image's first chunk. Only full chunks count (the
engines cache only full blocks). A request's cache salt (its tenant's, `security/tenants.py`)
seeds the first chunk's hash, as it does the engines' first block: one tenant's prompts never
score another's. Pure functions; safe in the preprocessing threads.

The hash is xxh3-64 on purpose, not the engines' SHA-256 (`engine/prefix_hash.py`): these hashes
only guess where a prefix probably is (an approximate index, never compared with an engine's), so
a chunk forged to collide with another prompt's steers one request to an instance and serves
nothing: the engine there compares a cached block's content before it reuses it. The media keys
folded in are the scheduler's keyed ones (`seams/media_keys.py`).
"""
from __future__ import annotations

import struct
from array import array
from collections.abc import Iterable, Sequence

import xxhash

CHUNK_TOKENS = 16
_PACK = struct.Struct("<Q").pack


class PromptChunker:
    """`visual_token_ids`: the placeholder token ids media expand to (image pad, video pad)."""

    def __init__(self, visual_token_ids: Iterable[int | None], chunk_tokens: int = CHUNK_TOKENS):
        if chunk_tokens < 1:
            raise ValueError("chunk_tokens must be >= 1")
        self.chunk_tokens = chunk_tokens
        self.visual = frozenset(t for t in visual_token_ids if t is not None)

    def hashes(self, token_ids: Sequence[int], media: Sequence = (), salt: str = "") -> list[int]:
        """Chained hashes of the full chunks of `token_ids`. `media`: the prompt's media in prompt
        order, each with `key`, `num_tokens`, `grid_thw` and `kind` (`PreparedMedia`); `salt`: the
        request's cache salt (seeds the first chunk's; empty: 0, as before salts)."""
        c = self.chunk_tokens
        n = len(token_ids) // c
        if n == 0:
            return []
        raw = array("q", token_ids[:n * c]).tobytes()
        spans = self._spans(token_ids, media)
        out, s, width = [], 0, 8 * c
        prev = xxhash.xxh3_64_intdigest(b"salt:" + salt.encode()) if salt else 0
        for i in range(n):
            lo, hi = i * c, (i + 1) * c
            data = _PACK(prev) + raw[i * width:(i + 1) * width]
            while s < len(spans) and spans[s][2] <= lo:  # spans wholly before this chunk
                s += 1
            for ident, start, end in spans[s:]:
                if start >= hi:
                    break
                a, b = max(lo, start), min(hi, end)
                data += f"{ident}|{a - start}|{b - a};".encode()
            prev = xxhash.xxh3_64_intdigest(data)
            out.append(prev)
        return out

    def _spans(self, token_ids: Sequence[int], media: Sequence) -> list[tuple[str, int, int]]:
        """(identity, first token, end) per media item, its placeholder tokens in prompt order (a
        video's placeholder runs, timestamps between, count as one span)."""
        if not media:
            return []
        positions = [i for i, t in enumerate(token_ids) if t in self.visual]
        out, r = [], 0
        for m in media:
            mine = positions[r:r + m.num_tokens]
            r += m.num_tokens
            if not mine:
                break
            grid = ",".join(str(int(x)) for x in m.grid_thw)
            out.append((f"{m.key}|{grid}|{getattr(m, 'kind', 'image')}", mine[0], mine[-1] + 1))
        return out
