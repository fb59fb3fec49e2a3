"""The --mode auto controller's policy on synthetic load windows, read from a real InstanceRegistry:
which stage is hot, which instance moves to which roles, hysteresis, dwell, cool-down, the last
instance of a needed role, a reason with every decision, the Prometheus counters, and the loop."""
import asyncio

import pytest
from prometheus_client import CollectorRegistry

from epdserve.metrics.controller import ControllerMetrics
from epdserve.rpc import common_pb2
from epdserve.scheduler.controller import (ControllerConfig, ControllerLoop, Move, Outcome, RoleController,
                                           roster_problem)
from epdserve.scheduler.pressure import LoadPoint, LoadWindow, PressureConfig
from epdserve.scheduler.registry import InstanceRegistry

QUIET = {}  # an idle instance's load
CFG = ControllerConfig(min_dwell_s=0.0, cooldown_s=30.0, min_samples=3, pressure=PressureConfig(window_s=30.0))


def registry(*specs) -> InstanceRegistry:
    """Instances from (id, roles) or (id, roles, compute) specs."""
    reg = InstanceRegistry()
    for iid, roles, *compute in specs:
        reg.register(common_pb2.InstanceStatus(instance_id=iid, roles=roles, address=f"h:{iid}",
                                               compute=compute[0] if compute else ""))
    return reg


def load(reg: InstanceRegistry, **loads) -> None:
    """Heartbeat every named instance with its load (the others stay idle)."""
    for rec in reg.records():
        reg.heartbeat(rec.instance_id, common_pb2.Load(**loads.get(rec.instance_id, QUIET)))


def decide_after(ctrl: RoleController, reg: InstanceRegistry, t0: float, n: int = 3, dt: float = 5.0):
    """n load samples from t0, then one decision at the last sample's time."""
    roster = []
    for i in range(n):
        roster = ctrl.sample(t0 + i * dt, reg.records())
    d = ctrl.decide(t0 + (n - 1) * dt, roster)
    assert d.reason  # every decision says why
    return d


def test_image_heavy_pressure_moves_a_cold_decoder_to_encode():
    reg = registry(("e0", "E"), ("p0", "P"), ("d0", "D"), ("d1", "D"))
    load(reg, e0={"queued_media": 12})  # 3x the threshold of 4 media per E
    d = decide_after(RoleController(CFG), reg, 0.0)
    assert d.outcome is Outcome.MOVE and d.move == Move("d0", "D", "E")
    assert d.pressures["E"] == pytest.approx(3.0)
    assert "E pressure 3.00 >= enter 1" in d.reason and "D pressure 0.00 <= stay 0.5" in d.reason
    reg = registry(("ep0", "EP"), ("ep1", "EP"), ("d0", "D"))  # EP-D: a co-located instance gives E all of it
    load(reg, ep0={"queued_media": 12}, ep1={"queued_media": 12})
    d = decide_after(RoleController(CFG), reg, 0.0)
    assert d.move == Move("ep0", "EP", "E") and "P pressure 0.00 <= stay 0.5 (0.00 after)" in d.reason


def test_decode_pressure_moves_a_spare_encoder_to_decode():
    reg = registry(("e0", "E"), ("e1", "E"), ("p0", "P"), ("d0", "D"))
    load(reg, d0={"free_kv_blocks": 5, "total_kv_blocks": 100, "running_requests": 20})
    d = decide_after(RoleController(CFG), reg, 0.0)
    assert d.outcome is Outcome.MOVE and d.move == Move("e0", "E", "D")
    assert d.pressures["D"] == pytest.approx(max(0.95 / 0.9, 20 / 16))


def test_tpot_misses_count_as_decode_pressure_and_ttft_misses_against_the_front_stage():
    reg = registry(("e0", "E"), ("e1", "E"), ("p0", "P"), ("d0", "D"))
    load(reg)
    ctrl = RoleController(CFG)
    for i in range(10):
        ctrl.observe_request(float(i), ttft_s=0.5, tpot_s=0.02 if i < 8 else 0.5)  # 20% over the TPOT SLO
    d = decide_after(ctrl, reg, 5.0)
    assert d.pressures["D"] == pytest.approx(0.2 / 0.1) and d.move == Move("e0", "E", "D")
    w = LoadWindow(PressureConfig(min_slo_requests=2))
    w.add_sample(0.0, [LoadPoint("e0", "E", queued_media=2), LoadPoint("p0", "P", queued_tokens=100)])
    for t in (1.0, 2.0):
        w.add_request(t, ttft_met=False, tpot_met=True)
    p = w.pressures(2.0)
    assert (p["E"].slo, p["P"].slo, p["D"].slo) == (pytest.approx(10.0), 0.0, 0.0)  # E's queue is the longer


def test_busy_share_from_the_engine_step_counter():
    w = LoadWindow(PressureConfig())
    for t, secs in ((0.0, 100.0), (10.0, 109.0)):  # 9 s of engine time in 10 s
        w.add_sample(t, [LoadPoint("pd0", "PD", engine_step_seconds=secs), LoadPoint("e0", "E", queued_media=1)])
    p = w.pressures(10.0)
    assert p["P"].busy == pytest.approx(1.0) and p["D"].busy == pytest.approx(1.0) and p["E"].busy == 0.0
    assert p["E"].queue == pytest.approx(0.25) and p["P"].capacity == 0.5  # PD counts half for each stage
    w.add_sample(20.0, [LoadPoint("pd0", "PD", engine_step_seconds=1.0)])  # restarted: counter went down
    assert w.pressures(20.0)["P"].busy == 0.0
    w.add_sample(100.0, [LoadPoint("pd0", "PD")])
    assert w.num_samples == 1  # older samples left the 30 s window


def test_busy_share_counts_vision_encoding_per_stage_worker():
    """Vision time (E workers, inline encoders) counts as busy too, and an instance with two stage
    workers on their own shares of the device (EP) is busy per worker."""
    w = LoadWindow(PressureConfig(busy_high=1.0))
    for t, k in ((0.0, 0.0), (10.0, 1.0)):
        w.add_sample(t, [LoadPoint("e0", "E", vision_seconds=8.0 * k),  # 8 s encoding in 10 s
                         LoadPoint("pe0", "P+E", engine_step_seconds=3.0 * k, vision_seconds=5.0 * k),
                         LoadPoint("ep0", "EP", engine_step_seconds=4.0 * k, vision_seconds=6.0 * k),
                         LoadPoint("d0", "D", engine_step_seconds=2.0 * k)])
    p = w.pressures(10.0)
    assert p["E"].busy == pytest.approx((0.8 + 0.8 + 0.5) / 3)  # e0, pe0 (3 + 5 s), ep0 ((4 + 6) / 2 workers)
    assert p["P"].busy == pytest.approx((0.8 + 0.5) / 2) and p["D"].busy == pytest.approx(0.2)


def test_hysteresis_enter_high_stay_until_low():
    reg = registry(("e0", "E"), ("p0", "P"), ("d0", "D"), ("d1", "D"))
    ctrl = RoleController(ControllerConfig(min_dwell_s=0.0, cooldown_s=0.0, min_samples=3))
    load(reg, e0={"queued_media": 3})  # 0.75: below enter, not hot yet
    d = decide_after(ctrl, reg, 0.0)
    assert d.outcome is Outcome.CALM and "no stage hot" in d.reason
    load(reg, e0={"queued_media": 5})  # 1.25: hot
    d = decide_after(ctrl, reg, 100.0)
    assert d.outcome is Outcome.MOVE and d.move == Move("d0", "D", "E")
    ctrl.switch_started(d.move, 110.0)
    reg.deregister("d0")
    reg.register(common_pb2.InstanceStatus(instance_id="d0-1", roles="E", address="h:d0"))
    ctrl.switch_finished(d.move, 111.0, ok=True)
    load(reg, e0={"queued_media": 3}, **{"d0-1": {"queued_media": 3}})  # 0.75: still hot (over stay 0.5)
    d = decide_after(ctrl, reg, 200.0)
    assert d.outcome is Outcome.MOVE and "E pressure 0.75 still over stay 0.5 since it went hot" in d.reason
    assert d.move == Move("d1", "D", "ED")  # the last D keeps its D worker: it only takes an E beside it
    load(reg, e0={"queued_media": 1}, **{"d0-1": {"queued_media": 1}})  # 0.25: no longer hot
    assert decide_after(ctrl, reg, 300.0).outcome is Outcome.CALM


def test_a_donor_stage_above_stay_or_pushed_to_enter_keeps_its_instance():
    reg = registry(("e0", "E"), ("p0", "P"), ("d0", "D"), ("d1", "D"))
    warm_p = {"queued_tokens": 1300}  # P at 0.63: not hot, but too warm to give anything up
    load(reg, e0={"queued_media": 8}, p0=warm_p, d0={"running_requests": 10}, d1={"running_requests": 10})  # D 0.625
    d = decide_after(RoleController(CFG), reg, 0.0)
    assert d.outcome is Outcome.BLOCKED and "D pressure 0.62 is above stay 0.5" in d.reason
    assert "p0 P -> E/EP/ED/EPD/P+E: P pressure 0.63 is above stay 0.5" in d.reason
    load(reg, e0={"queued_media": 8}, p0={"queued_tokens": 1100}, d0={"running_requests": 7},
         d1={"running_requests": 7})  # D at 0.44 (under stay 0.45), P at 0.54
    cfg = ControllerConfig(min_dwell_s=0, enter_pressure=0.55, stay_pressure=0.45)
    d = decide_after(RoleController(cfg), reg, 0.0)
    assert d.outcome is Outcome.BLOCKED
    assert "d0 D -> E/EP/P+E: D would be at 0.88 with 1 instances" in d.reason  # a whole D away: D goes hot
    assert "d0 D -> ED: D would be at 0.58 with 1.5 instances" in d.reason  # half of one: still too much


def test_dwell_and_cooldown_hold():
    reg = registry(("e0", "E"), ("p0", "P"), ("d0", "D"), ("d1", "D"))
    load(reg, e0={"queued_media": 12})
    ctrl = RoleController(ControllerConfig(min_dwell_s=100.0, cooldown_s=50.0, min_samples=3))
    assert ctrl.decide(0.0, ctrl.sample(0.0, reg.records())).outcome is Outcome.WARMING_UP
    d = decide_after(ctrl, reg, 10.0)
    assert d.outcome is Outcome.BLOCKED and "d0 (D): holds its roles 20 s (< dwell 100 s)" in d.reason
    d = decide_after(ctrl, reg, 100.0)
    assert d.outcome is Outcome.MOVE and d.move.instance_id == "d0"
    ctrl.switch_started(d.move, 110.0)
    assert ctrl.decide(111.0, []).outcome is Outcome.IN_PROGRESS
    reg.deregister("d0")
    reg.register(common_pb2.InstanceStatus(instance_id="d0-1", roles="E", address="h:d0"))
    ctrl.switch_finished(d.move, 120.0, ok=True)
    d = decide_after(ctrl, reg, 130.0)
    assert d.outcome is Outcome.COOLDOWN and "cool-down" in d.reason
    assert "d0" not in ctrl.since and ctrl.since["d0-1"] == 130.0  # the new id's dwell starts when it appears


def test_the_last_instance_of_a_needed_role_never_moves():
    reg = registry(("pe0", "P+E"), ("d0", "D"))  # P-D: encode pressure on the inline encoder
    load(reg, pe0={"queued_media": 40})
    d = decide_after(RoleController(CFG), reg, 0.0)
    assert d.outcome is Outcome.BLOCKED and d.move is None
    assert "d0 D -> E/EP/P+E: nothing would be left to prefill and decode" in d.reason
    assert "d0 D -> ED: E would idle" in d.reason
    reg = registry(("e0", "E"), ("p0", "P"), ("d0", "D"))  # E-P-D, one each: P and D keep their worker
    load(reg, e0={"queued_media": 40})
    d = decide_after(RoleController(CFG), reg, 0.0)
    assert d.move == Move("d0", "D", "ED") and roster_problem(["E", "P", "ED"]) is None
    reg = registry(("e0", "E"), ("pd0", "PD"))  # E-PD: decode pressure, the only E must stay
    load(reg, pd0={"free_kv_blocks": 0, "total_kv_blocks": 10})
    d = decide_after(RoleController(CFG), reg, 0.0)
    assert d.outcome is Outcome.BLOCKED and "images would need an E" in d.reason


def test_a_down_instance_does_not_count_as_the_spare():
    reg = registry(("e0", "E"), ("p0", "P"), ("d0", "D"), ("d1", "D"))
    for _ in range(3):
        reg.record_failure("d1")  # DOWN
    load(reg, e0={"queued_media": 12})
    d = decide_after(RoleController(CFG), reg, 0.0)
    assert d.move == Move("d0", "D", "ED")  # d0 -> E would leave no D: d1 does not count


def test_roster_rules():
    assert roster_problem(["EPD", "EPD"]) is None
    assert roster_problem(["E", "P", "D"]) is None and roster_problem(["EP", "D"]) is None
    assert roster_problem(["E", "PD"]) is None and roster_problem(["P+E", "D"]) is None
    assert "idle" in roster_problem(["E", "PD", "D"])  # routing sends every request to the coupled one
    assert "would need an E" in roster_problem(["P", "D"])
    assert "E would idle" in roster_problem(["E", "P+E", "D"])
    assert "nothing would be left" in roster_problem(["E", "P"])
    with pytest.raises(ValueError):
        ControllerConfig(enter_pressure=0.5, stay_pressure=0.5)


def test_decisions_and_switches_are_exported_as_prometheus_metrics():
    prom = CollectorRegistry()
    ctrl = RoleController(CFG, observer=ControllerMetrics(prom))
    reg = registry(("e0", "E"), ("p0", "P"), ("d0", "D"), ("d1", "D"))
    load(reg, e0={"queued_media": 12})
    d = decide_after(ctrl, reg, 0.0)
    ctrl.switch_started(d.move, 10.0)
    ctrl.switch_finished(d.move, 14.0, ok=False, detail="refused")
    assert ctrl.decide(15.0, []).outcome is Outcome.COOLDOWN
    get = prom.get_sample_value
    assert get("epdserve:role_switch_decisions_total", {"from_roles": "D", "to_roles": "E"}) == 1.0
    assert get("epdserve:role_switches_total", {"from_roles": "D", "to_roles": "E", "result": "failed"}) == 1.0
    assert get("epdserve:role_switch_seconds_sum") == 4.0
    assert get("epdserve:role_controller_holds_total", {"outcome": "cooldown"}) == 1.0
    assert get("epdserve:stage_pressure", {"stage": "E"}) == 0.0  # the window restarted after the switch


def test_loop_runs_one_switch_at_a_time():
    reg = registry(("e0", "E"), ("p0", "P"), ("d0", "D"), ("d1", "D"))
    clock = [0.0]
    calls = []

    async def switch(move: Move, reason: str, drain_timeout_s: float):
        calls.append((move, reason, drain_timeout_s))
        await asyncio.sleep(0)
        reg.deregister(move.instance_id)  # what SwitchRoles leaves behind: the old id gone, a new one
        reg.register(common_pb2.InstanceStatus(instance_id=move.instance_id + "-1", roles=move.to_roles,
                                               address="h:x"))

    async def main():
        loop = ControllerLoop(RoleController(CFG), reg.records, switch, clock=lambda: clock[0])
        loop.observe_request(ttft_s=0.1, tpot_s=0.01)
        assert list(loop.controller.window.finished) == [(0.0, True, True, 0)]
        outcomes = []
        for _ in range(4):
            load(reg, e0={"queued_media": 12})
            outcomes.append(loop.tick().outcome)
            if outcomes[-1] is Outcome.MOVE:
                assert loop.tick().outcome is Outcome.IN_PROGRESS
                await loop.wait_switch()
            clock[0] += 5.0
        return loop, outcomes

    loop, outcomes = asyncio.run(main())
    assert outcomes == [Outcome.WARMING_UP, Outcome.WARMING_UP, Outcome.MOVE, Outcome.COOLDOWN]
    assert [c[0] for c in calls] == [Move("d0", "D", "E")] and "E pressure" in calls[0][1]
    assert {r.instance_id: r.roles for r in reg.records()} == {"e0": "E", "p0": "P", "d0-1": "E", "d1": "D"}
    assert loop.controller.in_flight is None and all(d.reason for d in loop.decisions)


def test_requests_that_arrived_before_a_switch_ended_are_not_judged():
    """After a switch, SLO misses of requests queued under the old roster would blame the new one
    (a live run with dwell 10 s thrashed through ten switches that way)."""
    ctrl = RoleController(CFG)
    move = Move("d0", "D", "E")
    ctrl.switch_started(move, 10.0)
    ctrl.switch_finished(move, 12.0, ok=True)
    for i in range(10):  # finished after the switch, but arrived before its end: they missed under the old roster
        ctrl.observe_request(13.0 + i * 0.1, ttft_s=9.0, tpot_s=0.5, age_s=5.0)
    assert len(ctrl.window.finished) == 0
    ctrl.observe_request(20.0, ttft_s=9.0, tpot_s=0.5, age_s=1.0)  # arrived at 19: judged
    ctrl.observe_request(20.0, ttft_s=9.0, tpot_s=0.5)  # age unknown: judged
    assert len(ctrl.window.finished) == 2
