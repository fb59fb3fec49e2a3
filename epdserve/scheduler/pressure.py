"""Stage pressure over a sliding window: how far each stage (E, P, D) is past what it should carry.

Owns `PressureConfig` (the thresholds), `LoadWindow` (the last `window_s` seconds of roster load
samples and of finished requests' TTFT / TPOT against their SLOs) and `StagePressure` (one
stage's figure, with the terms it came from, for the controller's reason strings).

A pressure of 1.0 means "at the threshold". Per stage it is the largest of three terms:
- queue: the mean over the window's samples of the mean over the instances serving the stage of
  E: `queued_media / e_queue_media`; P: `queued_tokens / p_queue_tokens`; D: the larger of
  `(KV blocks in use / all) / kv_used_high` and `running_requests / d_batch_high`. (D's
  `waiting_requests` are not used: on a D-only instance they are mostly requests whose KV is
  still being prefilled elsewhere, i.e. P's queue.)
- busy: the instance's compute time (the counters `engine_step_seconds` + `vision_seconds`) grown
  over the window / the window's span / its number of stage workers (EP, ED: two, each on its own
  share of the device) / `busy_high`, for every stage it serves;
- slo: finished requests' SLO misses as a share / (1 - `slo_target`): TTFT misses count against
  the front stage (E or P, whichever has the larger queue or busy term; P on a tie), TPOT misses
  against D. Used only once `min_slo_requests` requests finished in the window.

Which stages an instance serves comes from its roles: E, EP, ED and the inline encoders (EPD,
P+E) serve E; anything with P serves P; anything with D serves D. A co-located instance counts
as a share 1/len(stages) of an instance for each of its stages (`capacity`).
"""
from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from epdserve.roles import DECODE, ENCODE, PREFILL, STAGES, role_set


def stages_of(roles: str) -> frozenset[str]:
    """The stages whose work an instance with `roles` runs ("P+E" encodes inline: E and P)."""
    return role_set(roles).stages


@dataclass(frozen=True)
class PressureConfig:
    window_s: float = 30.0
    e_queue_media: float = 4.0  # media waiting to be encoded, per E-serving instance, at pressure 1
    p_queue_tokens: float = 2048.0  # prompt + vision tokens waiting, per P-serving instance, at pressure 1
    d_batch_high: float = 16.0  # requests in a decode batch at pressure 1
    kv_used_high: float = 0.9  # share of KV blocks in use at pressure 1
    busy_high: float = 0.9  # engine busy share (step seconds / wall seconds) at pressure 1
    slo_target: float = 0.9  # SLO attainment aimed at: a miss share of 1 - target is pressure 1
    min_slo_requests: int = 5  # finished requests in the window before the SLO terms count

    def __post_init__(self):
        for name in ("window_s", "e_queue_media", "p_queue_tokens", "d_batch_high", "kv_used_high", "busy_high"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be > 0")
        if not 0.0 <= self.slo_target < 1.0:
            raise ValueError("slo_target must be in [0, 1)")
        if self.min_slo_requests < 1:
            raise ValueError("min_slo_requests must be >= 1")


@dataclass(frozen=True)
class LoadPoint:
    """What the window keeps of one instance at one sample (copied: records change in place)."""

    instance_id: str
    roles: str
    queued_media: int = 0
    queued_tokens: int = 0
    running_requests: int = 0
    waiting_requests: int = 0
    free_kv_blocks: int = 0
    total_kv_blocks: int = 0
    engine_step_seconds: float = 0.0
    vision_seconds: float = 0.0

    @classmethod
    def of(cls, instance_id: str, roles: str, load) -> LoadPoint:
        """From a `common_pb2.Load` (or anything with its field names)."""
        return cls(instance_id, roles, *(getattr(load, f, 0) or 0 for f in (
            "queued_media", "queued_tokens", "running_requests", "waiting_requests", "free_kv_blocks",
            "total_kv_blocks", "engine_step_seconds", "vision_seconds")))

    @property
    def stages(self) -> frozenset[str]:
        return stages_of(self.roles)

    @property
    def busy_seconds(self) -> float:
        return self.engine_step_seconds + self.vision_seconds

    def queue_term(self, stage: str, cfg: PressureConfig) -> float:
        if stage == ENCODE:
            return self.queued_media / cfg.e_queue_media
        if stage == PREFILL:
            return self.queued_tokens / cfg.p_queue_tokens
        kv = (1.0 - self.free_kv_blocks / self.total_kv_blocks) / cfg.kv_used_high if self.total_kv_blocks else 0.0
        return max(kv, self.running_requests / cfg.d_batch_high)


@dataclass(frozen=True)
class StagePressure:
    stage: str
    queue: float = 0.0
    busy: float = 0.0
    slo: float = 0.0
    capacity: float = 0.0  # instances serving it (a co-located instance counts its share)

    @property
    def value(self) -> float:
        return max(self.queue, self.busy, self.slo)

    def describe(self) -> str:
        """e.g. "E 2.10 (queue 2.10, busy 0.00, slo 0.50; 1.0 instances)"."""
        return (f"{self.stage} {self.value:.2f} (queue {self.queue:.2f}, busy {self.busy:.2f}, slo {self.slo:.2f}; "
                f"{self.capacity:g} instances)")


@dataclass
class LoadWindow:
    """The last `cfg.window_s` seconds of load samples and finished requests. Times are the
    caller's clock (monotonic seconds); every method trims what fell out of the window."""

    cfg: PressureConfig = field(default_factory=PressureConfig)
    samples: deque = field(default_factory=deque)  # (t, {instance_id: LoadPoint})
    cleared_at: float | None = None  # requests that arrived before this are not judged (a switch ended)
    finished: deque = field(default_factory=deque)  # (t, ttft_met, tpot_met, media items)

    def add_sample(self, t: float, points: list[LoadPoint]) -> None:
        self.samples.append((t, {p.instance_id: p for p in points}))
        self._trim(t)

    def add_request(self, t: float, ttft_met: bool, tpot_met: bool, media: int = 0,
                    arrived: float | None = None) -> None:
        """One finished request: did it meet the TTFT SLO, and the TPOT SLO (failures meet neither),
        how many media items (images, videos) it carried, and when it arrived. One that arrived
        before the last `clear(now)` is left out: the roster that served it is gone."""
        if arrived is not None and self.cleared_at is not None and arrived < self.cleared_at:
            return
        self.finished.append((t, bool(ttft_met), bool(tpot_met), int(media)))
        self._trim(t)

    def clear(self, now: float) -> None:
        """Forget everything, and every request that arrived before `now` (a switch ended)."""
        self.samples.clear()
        self.finished.clear()
        self.cleared_at = now

    def _trim(self, now: float) -> None:
        for q in (self.samples, self.finished):
            while q and q[0][0] < now - self.cfg.window_s:
                q.popleft()

    @property
    def num_samples(self) -> int:
        return len(self.samples)

    def pressures(self, now: float) -> dict[str, StagePressure]:
        """Every stage's pressure over the window, judged against the latest sample's roster."""
        self._trim(now)
        cfg = self.cfg
        latest = self.samples[-1][1] if self.samples else {}
        capacity = {s: sum(1.0 / len(p.stages) for p in latest.values() if s in p.stages) for s in STAGES}
        queue = {s: _mean([_mean([p.queue_term(s, cfg) for p in pts.values() if s in p.stages])
                           for _, pts in self.samples if any(s in p.stages for p in pts.values())]) for s in STAGES}
        busy = self._busy(latest)
        ttft, tpot = self._slo_terms()
        e, p = ENCODE, PREFILL
        front = e if capacity[e] and max(queue[e], busy[e]) > max(queue[p], busy[p]) else p
        slo = {e: ttft if front == e else 0.0, p: ttft if front == p else 0.0, DECODE: tpot}
        return {s: StagePressure(s, queue[s], busy[s], slo[s], capacity[s]) for s in STAGES}

    def _busy(self, latest: dict[str, LoadPoint]) -> dict[str, float]:
        """Per stage, the mean busy share of the latest roster's instances serving it: compute
        seconds (engine steps + vision encoding) per second of the window, per stage worker."""
        per: dict[str, list[float]] = {s: [] for s in STAGES}
        for iid, now_point in latest.items():
            first = next(((t, pts[iid]) for t, pts in self.samples if iid in pts), None)
            t_last = self.samples[-1][0]
            if first is None or t_last <= first[0] or now_point.busy_seconds < first[1].busy_seconds:
                continue  # one sample only, or the counters restarted
            share = (now_point.busy_seconds - first[1].busy_seconds) / (t_last - first[0])
            share /= len(role_set(now_point.roles).workers)
            for s in now_point.stages:
                per[s].append(share / self.cfg.busy_high)
        return {s: _mean(v) for s, v in per.items()}

    def media_per_request(self) -> float | None:
        """Mean media items per finished request in the window; None before `min_slo_requests`."""
        n = len(self.finished)
        if n < self.cfg.min_slo_requests:
            return None
        return sum(m for *_, m in self.finished) / n

    def _slo_terms(self) -> tuple[float, float]:
        n = len(self.finished)
        if n < self.cfg.min_slo_requests:
            return 0.0, 0.0
        allowed = 1.0 - self.cfg.slo_target  # > 0: validated
        ttft_miss = sum(1 for _, ok, _, _ in self.finished if not ok) / n
        tpot_miss = sum(1 for _, _, ok, _ in self.finished if not ok) / n
        return ttft_miss / allowed, tpot_miss / allowed


def _mean(values: list[float]) -> float:
    return sum(values) / len(values) if values else 0.0
