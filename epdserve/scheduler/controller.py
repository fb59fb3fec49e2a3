"""The `--mode auto` controller: which instance should switch roles, when, and why.

Owns `ControllerConfig`, the decision types (`Move`, `Decision`, `Outcome`), `RoleController`
(the policy: pure logic over a `pressure.LoadWindow`, no I/O, every clock value passed in) and
`ControllerLoop` (a small asyncio loop that samples the roster, asks the policy, and runs one
switch at a time through a callable it is given: the scheduler's Instance.SwitchRoles call).

One decision per tick, at most one move in flight:
1. a switch still running → hold (IN_PROGRESS);
2. within `cooldown_s` of the last switch's end → hold (COOLDOWN); cool-down should be at least
   the window, so that every decision judges samples of the roster it would change (the window
   is also cleared when a switch ends);
3. fewer than `min_samples` load samples in the window → hold (WARMING_UP);
4. no stage hot → hold (CALM). Hysteresis: a stage goes hot when its pressure (pressure.py)
   reaches `enter_pressure` and stays hot until it falls to `stay_pressure` or below;
5. for the hottest hot stage (then the next), the candidate moves: an instance takes a role set
   that gives the stage a larger share of it (for E: D -> E, P -> EP, EP -> E, PD -> E, ...; for
   D: E -> D, EP -> ED, E -> PD, ...). Refused, each with its reason: an instance that is
   draining, not routable or changed roles less than `min_dwell_s` ago; a move that takes from a
   stage whose pressure is above `stay_pressure` (hysteresis: a stage gives up capacity only when
   well below the level at which it asks for more), or that would push that stage to
   `enter_pressure` or more with the capacity left; a roster that could no longer serve every
   request (`roster_problem`: the last P or D, the last coupled PD/EPD, the last E while a
   prefiller needs one), or in which a role would idle (routing sends everything to coupled
   instances when there are any; an E idles when every prefiller encodes inline). The largest
   gain wins (a whole instance before half of one), then the fewest stages in the new role set,
   then the fewest stages taken, then the coolest donor, then the instance id. None left → hold
   (BLOCKED), with the refusals as the reason.

Before the stage moves (step 5), when a stage is hot: the coupling moves of coupling.py. Merge
(the one prefiller of a disaggregated roster takes decode too, the D instances park) when the
window's traffic is encode-light (`couple_media_max` media items per request or fewer), P is hot and
D calm (at most `stay_pressure`); split (the coupled instance gives decode back to a parked D) when
D is hot or the traffic is encode-heavy. The instance must have held its roles `min_dwell_s`;
parked instances are left out of the load window. A parked instance is not moved into a stage
when it shares its compute (`InstanceStatus.compute`: the same CPU cores or device) with an
instance that serves: a second engine there contends for the compute instead of adding any
(README 'Traffic that shifts, and `--mode auto`', probes A and B).

Stage moves (step 5) are off while every serving instance reports the same compute
(`stage_moves="auto"`; `InstanceStatus.compute`, e.g. one CPU host's cores): the instances already
share every core, so moving a stage's share from one to another adds that stage no compute, and a
co-located role set (EP, ED) pins each stage to a fixed half of the cores (`stage_moves="on"`
forces them; figures: README 'Traffic that shifts, and `--mode auto`'). Coupling moves stay on:
they change the pipeline (one engine instead of two processes and a KV hop), not a stage's share.

Not considered: moves of two instances at once (e.g. monolithic → E-PD needs EPD → E and EPD →
PD together; one at a time, the first leaves an idle E, which `roster_problem` refuses).
"""
from __future__ import annotations

import asyncio
import enum
import logging
import time
from collections.abc import Awaitable, Callable, Iterable
from dataclasses import dataclass, field

from epdserve.roles import ROLES, role_set
from epdserve.scheduler.coupling import coupling_move, is_coupled, parked
from epdserve.scheduler.pressure import STAGES, LoadPoint, LoadWindow, PressureConfig, StagePressure, stages_of

log = logging.getLogger(__name__)


STAGE_MOVES = ("auto", "on", "off")


@dataclass(frozen=True)
class ControllerConfig:
    pressure: PressureConfig = field(default_factory=PressureConfig)
    enter_pressure: float = 1.0  # a stage this hot asks for one more instance
    stay_pressure: float = 0.5  # a stage gives an instance up only at or below this
    min_dwell_s: float = 120.0  # an instance keeps new roles at least this long (also from the controller's start)
    cooldown_s: float = 60.0  # after a switch ends, before the next decision
    min_samples: int = 3  # load samples in the window before any move
    ttft_slo_s: float = 3.0  # per-request SLOs the attainment terms count against
    tpot_slo_s: float = 0.100
    tick_s: float = 5.0  # ControllerLoop: seconds between decisions
    drain_timeout_s: float = 60.0  # passed to SwitchRoles
    coupling: bool = True  # consider merge / split moves (coupling.py)
    stage_moves: str = "auto"  # on | off | auto: off while every serving instance shares one compute (see below)
    couple_media_max: float = 1.0  # media items per request at or under which traffic is encode-light

    def __post_init__(self):
        if not 0 < self.stay_pressure < self.enter_pressure:
            raise ValueError(f"need 0 < stay_pressure < enter_pressure, got {self.stay_pressure}, "
                             f"{self.enter_pressure}")
        for name in ("min_dwell_s", "cooldown_s", "drain_timeout_s", "couple_media_max"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name} must be >= 0")
        for name in ("ttft_slo_s", "tpot_slo_s", "tick_s"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be > 0")
        if self.min_samples < 1:
            raise ValueError("min_samples must be >= 1")
        if self.stage_moves not in STAGE_MOVES:
            raise ValueError(f"stage_moves must be one of {', '.join(STAGE_MOVES)}, got {self.stage_moves!r}")


class Outcome(enum.Enum):
    MOVE = "move"
    IN_PROGRESS = "in_progress"
    COOLDOWN = "cooldown"
    WARMING_UP = "warming_up"
    CALM = "calm"
    BLOCKED = "blocked"


@dataclass(frozen=True)
class Move:
    instance_id: str
    from_roles: str
    to_roles: str

    def __str__(self) -> str:
        return f"{self.instance_id} {self.from_roles} -> {self.to_roles}"


@dataclass(frozen=True)
class Decision:
    at: float  # the controller's clock
    outcome: Outcome
    reason: str
    move: Move | None = None
    pressures: dict[str, float] = field(default_factory=dict)  # stage -> pressure at decision time


@dataclass(frozen=True)
class RosterEntry:
    """One instance as the controller sees it (from the registry's `InstanceRecord`)."""

    instance_id: str
    roles: str
    routable: bool = True
    draining: bool = False
    compute: str = ""  # InstanceStatus.compute: equal values share their compute ("" unknown)

    @classmethod
    def of(cls, record) -> RosterEntry:
        return cls(record.instance_id, record.roles, bool(getattr(record, "routable", True)),
                    bool(getattr(record, "draining", False)), getattr(record, "compute", "") or "")


def shared_compute(roster: Iterable[RosterEntry]) -> str | None:
    """The one compute every entry runs on (`InstanceStatus.compute`), or None (several, or unknown)."""
    computes = {e.compute for e in roster}
    return next(iter(computes)) if len(computes) == 1 and "" not in computes else None


def roster_problem(roles: Iterable[str]) -> str | None:
    """Why instances with these role sets could not serve every request, or would leave one
    idle (the router's rules: scheduler/routing.py); None when they are fine."""
    roles = list(roles)
    coupled = [r for r in roles if is_coupled(r)]
    p_side = [r for r in roles if role_set(r).sends_kv]
    d_side = [r for r in roles if role_set(r).receives_kv]
    encoders = [r for r in roles if role_set(r).encodes_for_others]  # E, EP, ED: serve Encode calls
    if coupled and (p_side or d_side):
        return "coupled PD/EPD instances take every request, so P- or D-only roles beside them would idle"
    if not coupled and not (p_side and d_side):
        return "nothing would be left to prefill and decode (a P and a D, or a coupled PD/EPD)"
    prefillers = coupled or p_side
    if not encoders and any(not role_set(r).encodes_inline for r in prefillers):
        return "images would need an E: no E-serving instance left, and a prefiller does not encode inline"
    if encoders and all(role_set(r).encodes_inline for r in prefillers):
        return "E would idle: every prefilling instance encodes inline (EPD, P+E)"
    return None


class RoleController:
    """The policy. Feed it with `observe_request` (each finished request) and `sample` (the
    roster's load, every tick); `decide` says what to do now; `switch_started` /
    `switch_finished` tell it what the loop did. Single-threaded (the scheduler's event loop)."""

    def __init__(self, config: ControllerConfig | None = None, observer=None):
        self.config = config or ControllerConfig()
        self.window = LoadWindow(self.config.pressure)
        self.observer = observer  # optional: .on_decision(Decision), .on_switch(Move, ok: bool, seconds)
        self.since: dict[str, float] = {}  # instance id -> when it was first seen with its roles
        self.in_flight: Move | None = None
        self.hot: set[str] = set()  # stages that went over enter_pressure and have not yet fallen to stay_pressure
        self._started_at: float | None = None
        self.last_switch_end: float | None = None

    # ------------------------------------------------------------------ inputs
    def observe_request(self, now: float, ttft_s: float | None, tpot_s: float | None, ok: bool = True,
                        media: int = 0, age_s: float | None = None) -> None:
        """A finished request (failed ones: ok=False, a miss of both SLOs) with its media items and
        its age (seconds since it arrived). TPOT None (one output token) meets its SLO, as bench
        serve's goodput counts it. A request that arrived before the last switch ended is not
        judged: it was served (and queued) by the roster before it."""
        c = self.config
        self.window.add_request(now, ok and ttft_s is not None and ttft_s <= c.ttft_slo_s,
                                ok and (tpot_s is None or tpot_s <= c.tpot_slo_s), media,
                                None if age_s is None else now - age_s)

    def sample(self, now: float, records: Iterable) -> list[RosterEntry]:
        """One load sample of the roster (`InstanceRecord`s, or anything with instance_id, roles,
        load, routable, draining); returns the roster as the controller sees it."""
        records = list(records)
        entries = [RosterEntry.of(r) for r in records]
        for e in entries:
            self.since.setdefault(e.instance_id, now)
        live = {e.instance_id for e in entries}
        for gone in [i for i in self.since if i not in live]:
            del self.since[gone]
        serving = [r for r in records if getattr(r, "routable", True) and not getattr(r, "draining", False)]
        idle = parked([r.roles for r in serving])  # parked instances carry nothing: no load to judge
        self.window.add_sample(now, [LoadPoint.of(r.instance_id, r.roles, r.load)
                                     for r, p in zip(serving, idle) if not p])
        return entries

    def switch_started(self, move: Move, now: float) -> None:
        self.in_flight, self._started_at = move, now

    def switch_finished(self, move: Move, now: float, ok: bool, detail: str = "") -> None:
        """The switch ended (ok: the instance serves its new roles). The window restarts: its
        samples describe the roster before the switch."""
        seconds = now - (self._started_at if self._started_at is not None else now)
        self.in_flight, self._started_at, self.last_switch_end = None, None, now
        self.window.clear(now)
        (log.info if ok else log.warning)("role switch %s %s after %.1f s%s", move, "done" if ok else "failed",
                                          seconds, f": {detail}" if detail else "")
        if self.observer is not None:
            self.observer.on_switch(move, ok, seconds)

    # ------------------------------------------------------------------ policy
    def decide(self, now: float, roster: Iterable[RosterEntry]) -> Decision:
        roster = list(roster)
        pressures = self.window.pressures(now)
        decision = self._decide(now, roster, pressures)
        if self.observer is not None:
            self.observer.on_decision(decision)
        return decision

    def _decide(self, now: float, roster: list[RosterEntry], pressures: dict[str, StagePressure]) -> Decision:
        c = self.config
        values = {s: p.value for s, p in pressures.items()}

        def hold(outcome: Outcome, reason: str) -> Decision:
            return Decision(now, outcome, reason, None, values)

        if self.in_flight is not None:
            return hold(Outcome.IN_PROGRESS, f"switch {self.in_flight} still running")
        if self.last_switch_end is not None and now - self.last_switch_end < c.cooldown_s:
            return hold(Outcome.COOLDOWN, f"cool-down: last switch ended {now - self.last_switch_end:.0f} s ago "
                                          f"(< {c.cooldown_s:g} s)")
        if self.window.num_samples < c.min_samples:
            return hold(Outcome.WARMING_UP, f"{self.window.num_samples} load samples in the window "
                                            f"(need {c.min_samples})")
        summary = "; ".join(pressures[s].describe() for s in STAGES)
        self.hot = {s for s in STAGES if values[s] >= c.enter_pressure
                    or (s in self.hot and values[s] > c.stay_pressure)}
        hot = sorted(self.hot, key=lambda s: -values[s])
        if not hot:
            return hold(Outcome.CALM, f"no stage hot (enter at {c.enter_pressure:g}, stay over "
                                      f"{c.stay_pressure:g}): {summary}")
        refusals: list[str] = []
        if c.coupling:
            live = [e for e in roster if e.routable and not e.draining]
            cm = coupling_move(live, self.window.media_per_request(), self.hot, c.couple_media_max,
                               values["D"], c.stay_pressure)
            if cm is not None:
                age = now - self.since.get(cm.instance_id, now)
                if age >= c.min_dwell_s:
                    move = Move(cm.instance_id, cm.from_roles, cm.to_roles)
                    reason = f"{cm.why}; move {move}. {summary}"
                    log.info("controller: %s", reason)
                    return Decision(now, Outcome.MOVE, reason, move, values)
                refusals.append(f"{cm.why.split(':')[0]} wanted but {cm.instance_id} holds its roles {age:.0f} s "
                                f"(< dwell {c.min_dwell_s:g} s)")
        shared = shared_compute(e for e in roster if e.routable and not e.draining)
        if c.stage_moves == "off" or (c.stage_moves == "auto" and shared):
            why = "off" if c.stage_moves == "off" else (
                f"off: every instance runs on {shared}, where moving a stage share between them adds no compute")
            return hold(Outcome.BLOCKED, "; ".join(refusals + [f"{'/'.join(hot)} hot but stage moves {why}"])
                        + f". {summary}")
        for stage in hot:
            best, why = self._best_move(now, stage, roster, pressures)
            if best is not None:
                move, donors = best
                why_hot = (f">= enter {c.enter_pressure:g}" if values[stage] >= c.enter_pressure
                           else f"still over stay {c.stay_pressure:g} since it went hot")
                reason = f"{stage} pressure {values[stage]:.2f} {why_hot}; {donors}; move {move}. {summary}"
                log.info("controller: %s", reason)
                return Decision(now, Outcome.MOVE, reason, move, values)
            refusals.append(f"{stage} hot ({values[stage]:.2f}) but {why}")
        return hold(Outcome.BLOCKED, "; ".join(refusals) + f". {summary}")

    def _best_move(self, now: float, stage: str, roster: list[RosterEntry],
                   pressures: dict[str, StagePressure]) -> tuple[tuple[Move, str] | None, str]:
        c = self.config
        live = [e for e in roster if e.routable and not e.draining]
        options = []
        refused: dict[tuple[str, str], list[str]] = {}  # (instance, why) -> the targets refused for it
        idle = parked([x.roles for x in live])
        for e, is_parked in zip(live, idle):
            have = stages_of(e.roles)
            held = 1.0 / len(have) if stage in have else 0.0  # its share of the instance now
            if held == 1.0:
                continue
            sharing = [x for x, p in zip(live, idle) if is_parked and e.compute and not p and x.compute == e.compute]
            if sharing:
                refused[(f"{e.instance_id} ({e.roles})", f"parked on the compute {sharing[0].instance_id} runs on "
                         f"({e.compute}): an engine there would add a process, not compute")] = []
                continue
            age = now - self.since.get(e.instance_id, now)
            if age < c.min_dwell_s:
                why = f"holds its roles {age:.0f} s (< dwell {c.min_dwell_s:g} s)"
                refused[(f"{e.instance_id} ({e.roles})", why)] = []
                continue
            for target in ROLES:
                new = stages_of(target)
                gain = (1.0 / len(new) if stage in new else 0.0) - held
                if gain <= 0:
                    continue
                ok, why, worst = self._donor_check(have, new, pressures)
                problem = None if not ok else roster_problem([target if x is e else x.roles for x in live])
                if not ok or problem:
                    refused.setdefault((f"{e.instance_id} {e.roles} ->", problem or why), []).append(target)
                    continue
                options.append(((-gain, len(new), len(have - new), worst, e.instance_id, target),
                                Move(e.instance_id, e.roles, target), why))
        if not options:
            return None, ("no instance can move: " + "; ".join(f"{who}{' ' + '/'.join(t) if t else ''}: {why}"
                                                              for (who, why), t in refused.items())
                          if refused else "every routable instance already serves it")
        _, move, why = min(options, key=lambda o: o[0])
        return (move, why), ""

    def _donor_check(self, have: frozenset[str], new: frozenset[str],
                     pressures: dict[str, StagePressure]) -> tuple[bool, str, float]:
        """Can the stages `have` give up their share of the instance to become `new`? Returns
        (ok, reason, the worst projected pressure among the stages that lose share)."""
        c = self.config
        worst, parts = 0.0, []
        for s in sorted(have):
            lost = 1.0 / len(have) - (1.0 / len(new) if s in new else 0.0)
            if lost <= 0:
                continue
            p = pressures[s]
            if p.value > c.stay_pressure:
                return False, f"{s} pressure {p.value:.2f} is above stay {c.stay_pressure:g}", 0.0
            left = p.capacity - lost
            if left <= 1e-9:
                continue  # its last share: whether the stage may go is roster_problem's to say
            projected = p.value * p.capacity / left
            if projected >= c.enter_pressure:
                return False, (f"{s} would be at {projected:.2f} with {left:.3g} instances "
                               f"(>= enter {c.enter_pressure:g})"), 0.0
            worst = max(worst, projected)
            parts.append(f"{s} pressure {p.value:.2f} <= stay {c.stay_pressure:g} ({projected:.2f} after)")
        return True, "; ".join(parts) or "no stage gives anything up", worst


class ControllerLoop:
    """Every `config.tick_s`: sample the roster, decide, and start the decided switch as a task
    (one at a time). `switch(move, reason, drain_timeout_s)` is awaited in that task: it performs
    Instance.SwitchRoles and returns when the instance serves its new roles (raise on failure).
    `roster()` returns the registry's records. Decisions are kept in `decisions` (the last 100)."""

    def __init__(self, controller: RoleController, roster: Callable[[], Iterable],
                 switch: Callable[[Move, str, float], Awaitable[object]], clock: Callable[[], float] = time.monotonic):
        self.controller = controller
        self.roster = roster
        self.switch = switch
        self.clock = clock
        self.decisions: list[Decision] = []
        self._task: asyncio.Task | None = None

    def observe_request(self, ttft_s: float | None, tpot_s: float | None, ok: bool = True, media: int = 0,
                        age_s: float | None = None) -> None:
        """A finished public request, on the loop's clock (the scheduler's request path calls this)."""
        self.controller.observe_request(self.clock(), ttft_s, tpot_s, ok, media, age_s)

    def tick(self) -> Decision:
        """One decision now; a MOVE starts its switch task (needs a running event loop)."""
        now = self.clock()
        entries = self.controller.sample(now, self.roster())
        d = self.controller.decide(now, entries)
        if d.move is None and (not self.decisions or self.decisions[-1].outcome is not d.outcome):
            log.info("controller: %s: %s", d.outcome.value, d.reason)  # holds: logged when the outcome changes
        self.decisions = [*self.decisions[-99:], d]
        if d.move is not None:
            self.controller.switch_started(d.move, now)
            self._task = asyncio.get_running_loop().create_task(self._run_switch(d.move, d.reason))
        return d

    async def _run_switch(self, move: Move, reason: str) -> None:
        try:
            await self.switch(move, reason, self.controller.config.drain_timeout_s)
        except asyncio.CancelledError:
            self.controller.switch_finished(move, self.clock(), False, "cancelled")
            raise
        except Exception as e:  # the instance refused or failed: held, logged, decided again later
            self.controller.switch_finished(move, self.clock(), False, f"{type(e).__name__}: {e}")
        else:
            self.controller.switch_finished(move, self.clock(), True)

    async def run(self) -> None:
        """Until cancelled."""
        try:
            while True:
                self.tick()
                await asyncio.sleep(self.controller.config.tick_s)
        finally:
            if self._task is not None and not self._task.done():
                self._task.cancel()

    async def wait_switch(self) -> None:
        """Until the switch in flight (if any) has ended."""
        if self._task is not None:
            await asyncio.gather(self._task, return_exceptions=True)
