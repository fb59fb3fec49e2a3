"""Coupling moves of the `--mode auto` controller: fold prefill and decode into one engine, or split them.

Owns the two moves that change the *pipeline* rather than a stage's share of the instances:
- merge: the one prefilling instance of a disaggregated roster takes decode too (P+E -> EPD,
  EP -> EPD, P -> PD). Routing then sends every request to it (scheduler/routing.py: a coupled
  instance takes the whole request), and the D instances *park*: they stay up, hold their model,
  and get nothing until a split. Chosen when the traffic is encode-light (few media items per
  request) and the front stage is hot: a coupled engine has no KV hop and, on a host whose
  instances share the cores, one process instead of two contending for them.
- split: the coupled instance gives decode back to a parked D (EPD -> P+E, PD -> P). Chosen when
  D is hot, or the traffic is encode-heavy and a stage is hot: a coupled step loop runs long
  vision-encode steps between decode steps, which is what breaks TPOT.
The probes behind both rules (C: merge on text-heavy traffic; A: split on image-heavy; F: a
merge breaks TPOT when decode is busy) are in README 'Traffic that shifts, and `--mode auto`'.

`parked(roles)` says which instances of a roster routing leaves idle; `coupling_move(...)` returns
the move (or None) for the controller, which checks dwell and logs the reason.
"""
from __future__ import annotations

from dataclasses import dataclass

from epdserve.roles import DECODE, FUSED_PREFILL, PREFILL, role_set

MERGED = {FUSED_PREFILL: "EPD", "EP": "EPD", "P": "PD"}  # prefiller -> the coupled roles it becomes
SPLIT = {"EPD": FUSED_PREFILL, "PD": "P"}  # coupled -> the prefiller it becomes (decode goes to a parked D)


def is_coupled(roles: str) -> bool:
    return role_set(roles).coupled


def parked(roles: list[str]) -> list[bool]:
    """Per instance: does routing leave it idle? Beside a coupled instance every instance is, but
    an E that a coupled instance without inline encoding (PD) sends its images to."""
    coupled = [r for r in roles if is_coupled(r)]
    if not coupled:
        return [False] * len(roles)
    e_used = any(not role_set(r).encodes_inline for r in coupled)
    return [not is_coupled(r) and not (e_used and role_set(r).encode_only) for r in roles]


@dataclass(frozen=True)
class CouplingMove:
    instance_id: str
    from_roles: str
    to_roles: str
    why: str


def coupling_move(roster: list, media_per_request: float | None, hot: set[str], media_max: float,
                  d_pressure: float = 0.0, stay: float = 0.5) -> CouplingMove | None:
    """The merge or split this roster and traffic call for, or None.

    `roster`: routable, non-draining entries (instance_id, roles); `media_per_request`: the window's
    mean (None: too few finished requests to judge the traffic); `hot`: the hot stages;
    `d_pressure` / `stay`: decode's pressure and the controller's stay level. A merge needs decode
    calm (at most `stay`: a coupled loop must have TPOT to spare; probe F in the module docstring);
    a hot D splits again whatever the traffic."""
    if media_per_request is None or not hot:
        return None
    coupled = [e for e in roster if is_coupled(e.roles)]
    if not coupled:
        return _merge(roster, media_per_request, hot, media_max, d_pressure, stay)
    if len(coupled) != 1 or (media_per_request <= media_max and DECODE not in hot):
        return None
    return _split(roster, coupled[0], media_per_request, hot, media_max)


def _merge(roster: list, media_per_request: float, hot: set[str], media_max: float, d_pressure: float,
           stay: float) -> CouplingMove | None:
    prefillers = [e for e in roster if role_set(e.roles).prefills]
    if media_per_request > media_max or PREFILL not in hot or d_pressure > stay or len(prefillers) != 1:
        return None
    p = prefillers[0]
    target = MERGED.get(p.roles)
    if target is None:
        return None
    return CouplingMove(
        p.instance_id, p.roles, target,
        f"merge: traffic is encode-light ({media_per_request:.2f} media/request <= {media_max:g}), P is hot and "
        f"D calm ({d_pressure:.2f} <= {stay:g}): {p.instance_id} couples prefill and decode; the D instance(s) park")


def _split(roster: list, c, media_per_request: float, hot: set[str], media_max: float) -> CouplingMove | None:
    target = SPLIT.get(c.roles)
    spare_d = [e for e, idle in zip(roster, parked([e.roles for e in roster])) if idle and role_set(e.roles).decodes]
    if target is None or not spare_d:
        return None
    return CouplingMove(
        c.instance_id, c.roles, target,
        f"split: {'D is hot' if DECODE in hot else 'traffic is encode-heavy'} ({media_per_request:.2f} media/request, "
        f"{media_max:g} at most for encode-light; {'/'.join(sorted(hot))} hot): {c.instance_id} gives decode back "
        f"to parked {spare_d[0].instance_id}")
