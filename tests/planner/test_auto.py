"""`epdserve launch --mode auto`'s first step (planner/auto.py): a profile measured once and cached,
the planner's pick for the declared workload, and the launch spec it becomes (the controller on)."""
from __future__ import annotations

import json

import pytest

from epdserve.entrypoints.cli import build_parser
from epdserve.entrypoints.launch import spec_from_args
from epdserve.instance.modes import MODES
from epdserve.planner import auto


@pytest.fixture(scope="module")
def tiny_profile(qwen2_vl_tiny, tmp_path_factory):
    """A profile of the tiny model measured here (auto's own path: measured once, then cached)."""
    cache = tmp_path_factory.mktemp("profiles")
    old = auto.PROFILE_CACHE
    auto.PROFILE_CACHE = cache
    try:
        path = auto.ensure_profile(str(qwen2_vl_tiny), "cpu", None)
        again = auto.ensure_profile(str(qwen2_vl_tiny), "cpu", None)
    finally:
        auto.PROFILE_CACHE = old
    assert path == again and path.startswith(str(cache))  # cached: the second call measured nothing
    assert json.loads(open(path).read())["benchmark"] == "profile"
    return path


def test_plan_start_picks_a_mode_for_the_declared_workload(qwen2_vl_tiny, tiny_profile):
    plan = auto.plan_start(str(qwen2_vl_tiny), "cpu", tiny_profile, "image-heavy", 1.0, devices=2, requests=12)
    assert plan.mode in MODES and min(plan.encode, plan.prefill, plan.decode) >= 0
    assert plan.predicted_goodput > 0 and "image-heavy at 1 req/s" in plan.line()
    with pytest.raises(ValueError, match="expected-workload"):
        auto.plan_start(str(qwen2_vl_tiny), "cpu", tiny_profile, "no-such-traffic")


def test_launch_mode_auto_becomes_the_planned_mode_with_the_controller_on(qwen2_vl_tiny, tiny_profile):
    args = build_parser().parse_args(["launch", "--mode", "auto", "--model", str(qwen2_vl_tiny), "--profile",
                                      tiny_profile, "--expected-workload", "text-heavy", "--expected-rate", "0.5"])
    spec = spec_from_args(args)
    assert spec.mode in MODES and spec.planned and "text-heavy" in spec.planned
    assert "--controller" in spec.scheduler_args
    spec.pools()  # a launchable deployment
    fixed = spec_from_args(build_parser().parse_args(["launch", "--mode", "E-PD", "--model", str(qwen2_vl_tiny)]))
    assert "--controller" not in fixed.scheduler_args and fixed.planned is None


def test_auto_counts_devices_per_rank_with_a_profile_per_degree(qwen2_vl_tiny, tiny_profile, tmp_path):
    """--mode auto at per-stage degrees: a profile measured at TP2 (two real ranks over gloo), the
    plan fits the devices counting each instance's ranks, and the role controller stays off."""
    from epdserve.perf.profiler import run_profile

    tp2 = run_profile(str(qwen2_vl_tiny), "cpu", ["160x90"], [32], [1, 4], repeats=1, decode_steps=2,
                      tensor_parallel_size=2)
    one = json.loads(open(tiny_profile).read())
    assert tp2["tensor_parallel_size"] == 2 and "tensor_parallel_size" in one
    assert tp2["kv_bytes_per_token"] == one["kv_bytes_per_token"]  # every rank's heads: the bytes a D TP2 holds
    tp2_path = tmp_path / "tp2.json"
    tp2_path.write_text(json.dumps(tp2))
    profiles = f"{tiny_profile},{tp2_path}"
    args = build_parser().parse_args(["launch", "--mode", "auto", "--model", str(qwen2_vl_tiny), "--profile", profiles,
                                      "--prefill-tensor-parallel-size", "2", "--devices", "0,1,2",
                                      "--expected-workload", "text-heavy", "--expected-rate", "0.5"])
    spec = spec_from_args(args)
    assert "--prefill-tensor-parallel-size 2" in spec.planned and "controller is off" in spec.planned
    assert "--controller" not in spec.scheduler_args
    from epdserve.instance.modes import pool_degrees

    ranks = sum(p.count * d for p, d in zip(spec.pools(), pool_degrees(spec.pools(), 1, 1, 2, 0)))
    assert spec.prefill_tensor_parallel_size == 2 and ranks <= 3  # a P TP2 + D TP1 pair at most
    plan = auto.plan_start(str(qwen2_vl_tiny), "cuda", profiles, "text-heavy", 0.5, devices=2, requests=6,
                           degrees=auto.StageDegrees(lm=2))
    assert (plan.mode, plan.devices_used) == ("monolithic", 2) and plan.encode == plan.prefill == plan.decode == 1
    with pytest.raises(ValueError, match="no deployment fits 1 device"):
        auto.plan_start(str(qwen2_vl_tiny), "cuda", profiles, "text-heavy", 0.5, devices=1, requests=6,
                        degrees=auto.StageDegrees(lm=2))
    assert auto.profile_path(str(qwen2_vl_tiny), 2) != auto.profile_path(str(qwen2_vl_tiny), 1)  # cached per degree
