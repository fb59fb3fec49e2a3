"""`ControllerMetrics`: the `--mode auto` controller's decisions and switches as Prometheus metrics.

An observer of `scheduler.controller.RoleController` (its `on_decision` / `on_switch` hooks), so
nothing in scheduler/ imports prometheus_client. It registers on the registry it is given: the
scheduler's `ServingMetrics.registry`, so one /metrics scrape shows them beside the rest.

- `epdserve:role_switch_decisions_total{from_roles,to_roles}`: moves decided;
- `epdserve:role_switches_total{from_roles,to_roles,result}`: switches ended (ok / failed);
- `epdserve:role_switch_seconds`: how long the ended switches took (drain + rebuild);
- `epdserve:role_controller_holds_total{outcome}`: decisions without a move, by why (cooldown,
  warming_up, calm, blocked, in_progress);
- `epdserve:stage_pressure{stage}`: each stage's pressure at the last decision (1 = threshold).
"""
from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

P = "epdserve:"
_SWITCH_SECONDS = (0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0, 80.0, 160.0)


class ControllerMetrics:
    def __init__(self, registry: CollectorRegistry):
        r = registry
        self.decisions = Counter(P + "role_switch_decisions", "Role switches the auto controller decided",
                                 ["from_roles", "to_roles"], registry=r)
        self.switches = Counter(P + "role_switches", "Role switches ended, by result (ok, failed)",
                                ["from_roles", "to_roles", "result"], registry=r)
        self.switch_seconds = Histogram(P + "role_switch_seconds", "Duration of ended role switches (drain + rebuild)",
                                        buckets=_SWITCH_SECONDS, registry=r)
        self.holds = Counter(P + "role_controller_holds", "Controller decisions without a move, by outcome",
                             ["outcome"], registry=r)
        self.pressure = Gauge(P + "stage_pressure", "Stage pressure at the controller's last decision "
                              "(1 = at its threshold)", ["stage"], registry=r)

    def on_decision(self, decision) -> None:
        for stage, value in decision.pressures.items():
            self.pressure.labels(stage).set(value)
        if decision.move is not None:
            self.decisions.labels(decision.move.from_roles, decision.move.to_roles).inc()
        else:
            self.holds.labels(decision.outcome.value).inc()

    def on_switch(self, move, ok: bool, seconds: float) -> None:
        self.switches.labels(move.from_roles, move.to_roles, "ok" if ok else "failed").inc()
        self.switch_seconds.observe(max(0.0, seconds))
