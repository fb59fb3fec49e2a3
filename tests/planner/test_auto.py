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


def test_auto_with_a_tensor_parallel_degree_is_refused_naming_why(qwen2_vl_tiny, tiny_profile):
    """The planner's costs are profiled at one device per instance: it does not plan TP deployments."""
    for extra in (["--tensor-parallel-size", "2"], ["--instance-args", "--tensor-parallel-size 2"],
                  ["--encode-tensor-parallel-size", "2"], ["--prefill-tensor-parallel-size", "2"],
                  ["--decode-tensor-parallel-size", "4"]):
        args = build_parser().parse_args(["launch", "--mode", "auto", "--model", str(qwen2_vl_tiny), "--profile",
                                          tiny_profile, *extra])
        with pytest.raises(ValueError, match="--mode auto plans from costs profiled at one device per instance"):
            spec_from_args(args)
    tp = spec_from_args(build_parser().parse_args(["launch", "--mode", "E-PD", "--model", str(qwen2_vl_tiny),
                                                   "--tensor-parallel-size", "2"]))
    assert tp.instance_args[tp.instance_args.index("--tensor-parallel-size") + 1] == "2"
