"""The controller's coupling moves (scheduler/coupling.py) on synthetic windows read from a real
InstanceRegistry: merge a P-D roster when encode-light traffic makes P hot (D parks), split it
again when encode-heavy traffic makes a stage hot, which instances are parked, and what holds."""
from dataclasses import replace

import pytest

from epdserve.scheduler.controller import ControllerConfig, Move, Outcome, RoleController
from epdserve.scheduler.coupling import parked
from epdserve.scheduler.pressure import PressureConfig

from tests.scheduler.test_controller import decide_after, load, registry

CFG = ControllerConfig(min_dwell_s=0.0, cooldown_s=30.0, min_samples=3, pressure=PressureConfig(window_s=30.0))


def finished(ctrl: RoleController, n: int, media: int, ttft_s: float = 0.5, tpot_s: float = 0.02, t: float = 0.0):
    for i in range(n):
        ctrl.observe_request(t + i * 0.1, ttft_s=ttft_s, tpot_s=tpot_s, media=media)


def test_parked_instances_are_those_routing_leaves_idle():
    assert parked(["P+E", "D"]) == [False, False]
    assert parked(["EPD", "D"]) == [False, True]
    assert parked(["E", "PD", "D"]) == [False, False, True]  # PD sends its images to the E
    assert parked(["E", "EPD"]) == [True, False]  # EPD encodes inline
    assert parked(["EPD", "EPD"]) == [False, False]


def test_encode_light_traffic_with_a_hot_prefiller_merges_p_d_into_one_engine():
    reg = registry(("p0", "P+E"), ("d0", "D"))
    load(reg, p0={"queued_tokens": 4096})  # P queue 2x its threshold
    ctrl = RoleController(CFG)
    finished(ctrl, 10, media=0)
    d = decide_after(ctrl, reg, 0.0)
    assert d.outcome is Outcome.MOVE and d.move == Move("p0", "P+E", "EPD")
    assert "encode-light (0.00 media/request <= 1), P is hot and D calm" in d.reason and "park" in d.reason
    reg = registry(("e0", "E"), ("p0", "P"), ("d0", "D"))  # E-P-D: P -> PD, the E keeps encoding for it
    load(reg, p0={"queued_tokens": 4096})
    ctrl = RoleController(CFG)
    finished(ctrl, 10, media=1)
    assert decide_after(ctrl, reg, 0.0).move == Move("p0", "P", "PD")


def test_no_merge_while_decode_is_busy():
    """A coupled loop needs TPOT to spare: with D over the stay level the merge would trade TTFT for TPOT
    misses (text-heavy at 5 req/s on this CPU: 38% in SLO coupled, 54% P-D)."""
    reg = registry(("p0", "P+E"), ("d0", "D"))
    load(reg, p0={"queued_tokens": 4096}, d0={"running_requests": 12})  # D 0.75: calm enough to keep, not to merge
    ctrl = RoleController(CFG)
    finished(ctrl, 10, media=0)
    d = decide_after(ctrl, reg, 0.0)
    assert d.move is None and d.pressures["D"] == pytest.approx(0.75)


def test_a_hot_decoder_splits_a_merged_roster_even_on_text_traffic():
    reg = registry(("m0", "EPD"), ("d0", "D"))
    load(reg)
    ctrl = RoleController(CFG)
    finished(ctrl, 10, media=0, tpot_s=0.3)
    d = decide_after(ctrl, reg, 0.0)
    assert d.move == Move("m0", "EPD", "P+E") and "split: D is hot" in d.reason


def test_image_heavy_traffic_never_merges_and_two_prefillers_never_merge():
    reg = registry(("p0", "P+E"), ("d0", "D"))
    load(reg, p0={"queued_tokens": 4096})
    ctrl = RoleController(CFG)
    finished(ctrl, 10, media=3)
    d = decide_after(ctrl, reg, 0.0)
    assert d.outcome is Outcome.BLOCKED and "merge" not in d.reason  # the stage moves have nothing legal
    reg = registry(("p0", "P+E"), ("p1", "P+E"), ("d0", "D"))
    load(reg, p0={"queued_tokens": 4096}, p1={"queued_tokens": 4096})
    ctrl = RoleController(CFG)
    finished(ctrl, 10, media=0)
    assert decide_after(ctrl, reg, 0.0).move != Move("p0", "P+E", "EPD")


def test_encode_heavy_traffic_splits_the_coupled_engine_back_onto_the_parked_decoder():
    reg = registry(("m0", "EPD"), ("d0", "D"))
    load(reg)
    ctrl = RoleController(CFG)
    finished(ctrl, 10, media=3, tpot_s=0.3)  # every request over the TPOT SLO: D hot
    d = decide_after(ctrl, reg, 0.0)
    assert d.outcome is Outcome.MOVE and d.move == Move("m0", "EPD", "P+E")
    assert "split: D is hot (3.00 media/request" in d.reason and "parked d0" in d.reason
    assert d.pressures["D"] == pytest.approx(10.0)  # the miss share 1.0 over the allowed 0.1


def test_a_merged_roster_stays_merged_on_encode_light_traffic_and_waits_out_its_dwell():
    reg = registry(("m0", "EPD"), ("d0", "D"))
    load(reg, m0={"queued_tokens": 4096}, d0={"running_requests": 40})  # a parked instance's load is not judged
    ctrl = RoleController(CFG)
    finished(ctrl, 10, media=0)
    d = decide_after(ctrl, reg, 0.0)
    assert d.pressures["D"] == 0.0 and "split" not in d.reason
    # P hot: the stage moves may scale the coupled engine out (the parked D becomes a second EPD)
    assert d.move == Move("d0", "D", "EPD")
    ctrl = RoleController(ControllerConfig(min_dwell_s=100.0, min_samples=3))
    finished(ctrl, 10, media=3, tpot_s=0.3)
    d = decide_after(ctrl, reg, 0.0)
    assert d.outcome is Outcome.BLOCKED and "split wanted but m0 holds its roles" in d.reason


def test_a_parked_instance_on_the_compute_of_the_coupled_engine_is_not_made_a_second_engine():
    """The same hot coupled engine, but the parked D runs on the same CPU cores (InstanceStatus.compute,
    from the registry). Stage moves on (forced: auto turns them off on one compute, below): a second
    EPD there would contend for the cores, not add any, so the coupled engine takes the share itself
    instead; on other compute (another device) the parked D becomes the second engine."""
    for d_compute, expect in (("cpu@h", Move("m0", "EPD", "EP")), ("npu:1@h", Move("d0", "D", "EPD"))):
        reg = registry(("m0", "EPD", "cpu@h"), ("d0", "D", d_compute))
        assert reg.get("d0").compute == d_compute and reg.get("d0").to_proto().compute == d_compute
        load(reg, m0={"queued_tokens": 4096})
        ctrl = RoleController(replace(CFG, stage_moves="on"))
        finished(ctrl, 10, media=0)
        assert decide_after(ctrl, reg, 0.0).move == expect


def test_stage_moves_are_off_by_default_where_every_instance_shares_one_compute():
    """auto: E-P-D on one CPU host with E hot — no stage move (a share moved between processes on the
    same cores adds no compute); the same roster on three devices moves D -> ED as before; `on`
    forces it on one host too. Coupling moves are not affected."""
    def decide(compute, **cfg):
        reg = registry(*((iid, roles, compute(iid)) for iid, roles in (("e0", "E"), ("p0", "P"), ("d0", "D"))))
        load(reg, e0={"queued_media": 12})  # E 3x its threshold
        return decide_after(RoleController(replace(CFG, **cfg)), reg, 0.0)

    one_host = decide(lambda iid: "cpu@h")
    assert one_host.outcome is Outcome.BLOCKED and one_host.move is None
    assert "E hot but stage moves off: every instance runs on cpu@h" in one_host.reason
    assert decide(lambda iid: f"npu:{'epd'.index(iid[0])}@h").move == Move("d0", "D", "ED")
    assert decide(lambda iid: "cpu@h", stage_moves="on").move == Move("d0", "D", "ED")
    assert "stage moves off" in decide(lambda iid: "npu:0@h", stage_moves="off").reason
    reg = registry(("p0", "P+E", "cpu@h"), ("d0", "D", "cpu@h"))  # a merge on one host still happens
    load(reg, p0={"queued_tokens": 4096})
    ctrl = RoleController(CFG)
    finished(ctrl, 10, media=0)
    assert decide_after(ctrl, reg, 0.0).move == Move("p0", "P+E", "EPD")
    with pytest.raises(ValueError, match="stage_moves"):
        ControllerConfig(stage_moves="sometimes")


def test_coupling_can_be_turned_off():
    reg = registry(("m0", "EPD"), ("d0", "D"))
    load(reg)
    ctrl = RoleController(ControllerConfig(min_dwell_s=0.0, min_samples=3, coupling=False))
    finished(ctrl, 10, media=3, tpot_s=0.3)
    assert decide_after(ctrl, reg, 0.0).move is None


def test_the_scheduler_flags_make_the_controller_config(tmp_path):
    import argparse

    from epdserve.entrypoints.scheduler_cli import add_parser, config_from_args

    p = argparse.ArgumentParser()
    add_parser(p.add_subparsers())
    args = p.parse_args(["scheduler", "--model", str(tmp_path), "--controller", "--controller-window-s", "12",
                         "--controller-couple-media-max", "0.5", "--controller-no-coupling",
                         "--controller-stage-moves", "on"])
    c = config_from_args(args).controller
    assert c.pressure.window_s == 12.0 and c.couple_media_max == 0.5 and c.coupling is False
    assert c.stage_moves == "on"
    off = config_from_args(p.parse_args(["scheduler", "--model", str(tmp_path)])).controller
    assert off is None
