"""Prompt block hashes: what cache-aware routing (`prefix_index.py`, `routing.py`) knows of a prompt.

The scheduler tokenizes every request (`preprocess.py`), so it hashes the expanded token ids the
engines will prefill, with the engines' own prefix hash (`seams/prefix_hash.py`: SHA-256 chained
over full blocks, the media identity of every item whose placeholder tokens fall in a block
folded in): in blocks of each prefill pool's block size, as its instances registered it
(`InstanceStatus.block_size`: 16 on CPU and CUDA, 128 on NPU), so a prompt's hashes are the
digests of the very blocks an engine of that pool caches. Only full blocks count (engines cache
only full blocks). A request's cache salt (its tenant's, `security/tenants.py`) seeds the first
block's parent, as it does the engines' (`first_parent`): one tenant's prompts never score
another's. Pure functions; safe in the preprocessing threads.

The index these hashes go into is still a guess of where a prefix probably is (the router
records where it sent a prompt; engines evict unseen): a collision, if one could be forged,
steers one request to an instance and serves nothing (the engine compares a cached block's
content before it reuses it). The media keys folded in are the scheduler's keyed ones
(`seams/media_keys.py`), the same keys the engines are given.
"""
from __future__ import annotations

from collections.abc import Iterable, Sequence

from epdserve.rpc.video_spec import video_timing
from epdserve.seams.prefix_hash import media_extra, prompt_keys

DEFAULT_BLOCK_SIZE = 16  # an instance that registers no block size (an older one, or adopted statically)


def media_identity(media: Sequence) -> list[tuple[str, str, int]]:
    """(key, extra, num_tokens) per `PreparedMedia` in prompt order, as the engines hash them
    (a video's timing is its sampling spec: `video_timing`)."""
    out = []
    for m in media:
        video = getattr(m, "video", None)  # set for every video (dispatcher: MediaRef.video)
        timing = video_timing(video) if video is not None else None
        out.append((m.key, media_extra(m.grid_thw, timing), int(m.num_tokens)))
    return out


class PromptChunker:
    """`visual_token_ids`: the placeholder token ids media expand to (image pad, video pad)."""

    def __init__(self, visual_token_ids: Iterable[int | None]):
        self.visual = frozenset(t for t in visual_token_ids if t is not None)

    def hashes(self, token_ids: Sequence[int], media: Sequence = (),
               block_size: int = DEFAULT_BLOCK_SIZE, salt: str = "") -> list[bytes]:
        """The digests of the full blocks of `token_ids` (`block_size` tokens each), each naming the
        prefix up to its block. `media`: the prompt's media in prompt order, each with `key`,
        `num_tokens`, `grid_thw`, `kind` and (videos) `video` (`PreparedMedia`); `salt`: the
        request's cache salt (its first block's parent, as in the engines)."""
        return [k.digest for k in prompt_keys(token_ids, media_identity(media), self.visual, block_size, salt)]

    def by_block_size(self, token_ids: Sequence[int], media: Sequence,
                      block_sizes: Iterable[int], salt: str = "") -> dict[int, list[bytes]]:
        """`hashes` for each block size the prefill pools use."""
        return {bs: self.hashes(token_ids, media, bs, salt) for bs in sorted(set(block_sizes))}
