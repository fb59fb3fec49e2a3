"""Role sets: which of the stages Encode, Prefill and Decode one engine or instance runs.

`normalize_roles` is the one parser of a role string, used by the engine's config, the
instance's config and the scheduler's registry alike, so all three accept and refuse the same
strings. No torch here: the scheduler imports it.
"""
from __future__ import annotations

# "P+E": one engine that encodes inline, then prefills and hands the KV to a D instance (mode
# P-D, EPD-Serve's "PD disaggregation" baseline). Not EP (E and P co-located as two workers),
# not PD (prefill and decode coupled in one engine).
FUSED_PREFILL = "P+E"
ROLES = ("E", "P", "D", "EP", "ED", "PD", "EPD", FUSED_PREFILL)


def normalize_roles(roles: str) -> str:
    """Canonical order ("pe" → "EP"); ValueError for anything but a non-empty set of E, P, D
    (each at most once, case-insensitive, surrounding spaces ignored), or "P+E"."""
    text = (roles or "").strip().upper().replace(" ", "")
    if text == FUSED_PREFILL:
        return FUSED_PREFILL
    if not text or any(c not in "EPD" for c in text) or len(set(text)) != len(text):
        raise ValueError(f"roles must be one of {', '.join(ROLES)}, got {roles!r}")
    return "".join(r for r in "EPD" if r in text)


def served_stages(roles: str) -> str:
    """The stages other instances may call on (Encode / Prefill / Decode RPCs): "P+E" serves
    Prefill only — its encoding is inline, for its own requests."""
    return "P" if roles == FUSED_PREFILL else roles


def engine_stages(roles: str) -> str:
    """The stages one engine of this role set runs, as E/P/D letters ("P+E" → "EP")."""
    return "EP" if roles == FUSED_PREFILL else roles


def encodes_inline(roles: str) -> bool:
    """Does one engine of this role set encode the media of the requests it prefills itself?"""
    return roles in ("EPD", FUSED_PREFILL)
