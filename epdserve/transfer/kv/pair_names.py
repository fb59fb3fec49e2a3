"""Pair names: "<P id>><D id>/g<n>", one per P–D pair and rebuild; the decode side names them.

A pair that broke is rebuilt under the next generation n, so a late message for the old pair can
never join the new group.
"""
from __future__ import annotations


def pair_name(prefill_peer: str, decode_id: str, generation: int) -> str:
    return f"{prefill_peer}>{decode_id}/g{generation}"


def pair_generation(name: str) -> int:
    """The n of a name ending in "/g<n>"; a missing suffix counts as 0."""
    head, sep, gen = name.rpartition("/g")
    return int(gen) if sep and gen.isdigit() else 0
