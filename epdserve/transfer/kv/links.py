"""Which prefill rank sends which KV heads to which decode rank: the links of a hop between two
tensor-parallel degrees.

A P instance at degree m and a D instance at degree n split the model's KV heads by the same rule
(kv_layout.py `rank_kv_heads`: KVH/tp heads a rank, or — tp a multiple of KVH — one head held
alike by tp/KVH ranks). Every D rank must end up with exactly the heads it holds; each of those
heads comes from one P rank holding it (when P replicates a head, the replicas take turns over the
D ranks, so no P rank sends more than its share). A `Link` is one (P rank, D rank) pair and the
consecutive heads it carries; both sides derive the same list from (KVH, m, n) alone, so the
bytes each D rank receives are the bytes its heads need, no more — nothing of the head map
travels but the degrees, and the receiver checks those against its own.

The pair's group has m + n ranks: P rank r is group rank r, D rank s is group rank m + s.
"""
from __future__ import annotations

from dataclasses import dataclass

from epdserve.kv_layout import KvShare, rank_kv_heads

__all__ = ["KvShare", "Link", "group_peers", "held_heads", "hop_links", "links_from", "links_into"]


@dataclass(frozen=True)
class Link:
    p_rank: int
    d_rank: int
    heads: range  # the model's KV heads this link carries (consecutive)

    def src_offset(self, num_kv_heads: int, p_degree: int) -> int:
        """Where the link's first head sits among its P rank's own heads."""
        return self.heads.start - rank_kv_heads(num_kv_heads, p_degree, self.p_rank).start

    def dst_offset(self, num_kv_heads: int, d_degree: int) -> int:
        """Where the link's first head sits among its D rank's own heads."""
        return self.heads.start - rank_kv_heads(num_kv_heads, d_degree, self.d_rank).start


def hop_links(num_kv_heads: int, p_degree: int, d_degree: int) -> list[Link]:
    """Every link of a P TP`p_degree` → D TP`d_degree` hop, ordered by (D rank, first head)."""
    p_maps = [rank_kv_heads(num_kv_heads, p_degree, r) for r in range(p_degree)]
    links: list[Link] = []
    for s in range(d_degree):
        start = prev = src = None
        for h in rank_kv_heads(num_kv_heads, d_degree, s):
            holders = [r for r, held in enumerate(p_maps) if h in held]
            r = holders[s % len(holders)]
            if src is not None and r == src and h == prev + 1:
                prev = h
                continue
            if src is not None:
                links.append(Link(src, s, range(start, prev + 1)))
            start = prev = h
            src = r
        if src is not None:
            links.append(Link(src, s, range(start, prev + 1)))
    return links


def links_from(links: list[Link], p_rank: int) -> list[Link]:
    """The links P rank `p_rank` sends on, in the order it posts them (by D rank)."""
    return [l for l in links if l.p_rank == p_rank]


def links_into(links: list[Link], d_rank: int) -> list[Link]:
    """The links D rank `d_rank` receives on, in the order it posts them (by first head)."""
    return [l for l in links if l.d_rank == d_rank]


def group_peers(p_degree: int, d_degree: int, links: list[Link], group_rank: int) -> list[int]:
    """The group ranks `group_rank` exchanges messages with: its links, P rank 0 with D rank 0
    (the acknowledgement) and D rank 0 with every other D rank (acceptance and acknowledgement)."""
    pairs = {(l.p_rank, p_degree + l.d_rank) for l in links} | {(0, p_degree)}
    pairs |= {(p_degree, p_degree + s) for s in range(1, d_degree)}
    return sorted({b if a == group_rank else a for a, b in pairs if group_rank in (a, b)})



def held_heads(num_kv_heads: int, degree: int) -> int:
    """KV heads held over an instance's ranks, a replicated head once per rank holding it: what
    a hop into that instance carries per block (D's heads' bytes)."""
    return sum(len(rank_kv_heads(num_kv_heads, degree, r)) for r in range(degree))
