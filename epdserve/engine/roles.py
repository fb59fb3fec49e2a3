"""Role sets: which of the stages Encode, Prefill and Decode one engine or instance runs.

`normalize_roles` is the one parser of a role string, used by the engine's config, the
instance's config and the scheduler's registry alike, so all three accept and refuse the same
strings. No torch here: the scheduler imports it.
"""
from __future__ import annotations

ROLES = ("E", "P", "D", "EP", "ED", "PD", "EPD")


def normalize_roles(roles: str) -> str:
    """Canonical order ("pe" → "EP"); ValueError for anything but a non-empty set of E, P, D
    (each at most once, case-insensitive, surrounding spaces ignored)."""
    text = (roles or "").strip().upper()
    if not text or any(c not in "EPD" for c in text) or len(set(text)) != len(text):
        raise ValueError(f"roles must be one of {', '.join(ROLES)}, got {roles!r}")
    return "".join(r for r in "EPD" if r in text)
