"""The shift workload: phases shaped by their presets, one continuous arrival process with recorded
boundaries, per-phase metrics in the report, and the timeline plot with phase boundaries and events."""
import json

import numpy as np
import pytest

from epdserve.bench.report import markdown, plot
from epdserve.bench.serve import run_target, workload_configs
from epdserve.bench.serve_runner import RunConfig, run_requests
from epdserve.bench.shift import DEFAULT_PHASES, ShiftConfig, build_shift, events_of, shift_config
from epdserve.perf.arrivals import arrival_times
from epdserve.perf.serving_metrics import SLO
from tests.bench.test_serve import FakeBackend, _args

SMALL = {"resolution_scale": 0.05}


def _phase_requests(run):
    return [run.requests[ph.first:ph.first + ph.count] for ph in run.phases]


def test_each_phase_takes_its_presets_shape():
    cfg = shift_config({"num_requests": 37, "seed": 3, **SMALL})
    assert [p.num_requests for p in cfg.phases] == [13, 12, 12] and cfg.num_requests == 37
    run = build_shift(cfg, rate=2.0)
    assert [ph.name for ph in run.phases] == list(DEFAULT_PHASES) and [ph.first for ph in run.phases] == [0, 13, 25]
    heavy, text, mixed = _phase_requests(run)
    assert all(r.kind == "image" and 2 <= len(r.images) <= 4 and 4 <= r.max_tokens <= 24 for r in heavy)
    assert sum(r.kind == "text" for r in text) >= 6 and all(32 <= r.max_tokens <= 160 for r in text)
    assert {r.kind for r in mixed} == {"image", "text"} and all(4 <= r.max_tokens <= 48 for r in mixed)
    assert len({r.request_id for r in run.requests}) == 37
    again = build_shift(cfg, rate=2.0)
    assert [r.images for r in again.requests] == [r.images for r in run.requests] and again.offsets == run.offsets
    other = build_shift(cfg.with_(seed=4), rate=2.0)
    assert other.offsets != run.offsets and [r.images for r in other.requests] != [r.images for r in run.requests]


def test_shift_phases_flag_orders_the_phases_and_scales_their_rates():
    (cfg,) = workload_configs(_args(argv=["--workload", "shift", "--num-requests", "30",
                                          "--shift-phases", "text-heavy:3,image-heavy"]))
    assert [p.name for p in cfg.phases] == ["shift0-text-heavy", "shift1-image-heavy"] and cfg.factors == (3.0, 1.0)
    run = build_shift(cfg, rate=1.0)
    assert [ph.rate for ph in run.phases] == [3.0, 1.0]
    (plain,) = workload_configs(_args(argv=["--workload", "shift", "--num-requests", "30"]))
    assert plain.factors == (1.0, 1.0, 1.0)
    with pytest.raises(SystemExit, match="must be a number"):
        workload_configs(_args(argv=["--workload", "shift", "--shift-phases", "mixed:fast"]))
    with pytest.raises(SystemExit, match="unknown phase preset"):
        workload_configs(_args(argv=["--workload", "shift", "--shift-phases", "video-ish"]))


def test_arrivals_are_one_continuous_process_with_phase_boundaries():
    cfg = shift_config({"num_requests": 30, **SMALL})
    run = build_shift(cfg, rate=2.0, burstiness=0.5)
    assert run.offsets == arrival_times(30, 2.0, 0.5, seed=0)  # what `epdserve plan --trace` replays
    starts = [ph.start_s for ph in run.phases]
    assert starts == [0.0, run.offsets[10], run.offsets[20]]
    assert [ph.end_s for ph in run.phases[:-1]] == starts[1:] and run.phases[-1].end_s == run.offsets[-1] + 0.5
    fast = build_shift(ShiftConfig(cfg.phases, rate_factors=(1.0, 4.0, 1.0)), rate=2.0, burstiness=0.5)
    gaps, fast_gaps = np.diff(run.offsets), np.diff(fast.offsets)  # gap j comes before request j + 1
    assert np.allclose(fast_gaps[9:19], gaps[9:19] / 4)
    assert np.allclose(fast_gaps[:9], gaps[:9]) and np.allclose(fast_gaps[19:], gaps[19:])
    assert [ph.rate for ph in fast.phases] == [2.0, 8.0, 2.0]
    assert build_shift(cfg, rate=float("inf")).offsets == [0.0] * 30
    for bad in (lambda: shift_config({"num_requests": 2}), lambda: shift_config(phases=("image-heavy", "potato")),
                lambda: ShiftConfig(cfg.phases, rate_factors=(1.0,)), lambda: build_shift(cfg, rate=0)):
        with pytest.raises(ValueError):
            bad()
    with pytest.raises(ValueError):
        run_requests(FakeBackend(), run.requests, RunConfig(progress=False), offsets=[0.0])


def test_run_target_reports_phases_and_plots_the_timeline_with_events(tmp_path):
    args = _args(argv=["--workload", "shift", "--num-requests", "6", "--resolution-scale", "0.05", "--output-len", "3",
                       "--output-len-std", "0", "--output-len-range", "3-3"])
    [cfg] = workload_configs(args)
    assert isinstance(cfg, ShiftConfig) and cfg.num_requests == 6 and cfg.phases[0].images_min == 2
    slo = SLO(ttft_ms=1000, tpot_ms=500)
    report = {"slo": slo.to_dict(), "workloads": {}}
    for label in ("monolithic", "auto"):
        run_target(FakeBackend(gap=0.002), label, [cfg], "40", args, slo, report, lambda: None)
    w = report["workloads"]["shift"]
    assert "image-heavy (2 req) -> text-heavy (2 req) -> mixed (2 req)" in w["summary"]
    run = w["modes"]["auto"]["runs"][0]
    assert run["metrics"]["completed"] == 6
    assert [p["name"] for p in run["phases"]] == list(DEFAULT_PHASES)
    for p in run["phases"]:
        m = p["metrics"]
        assert m["num_requests"] == 2 and m["good_requests"] == 2 and m["ttft_ms"]["median"] > 0
        assert m["goodput"] == pytest.approx(2 / p["window_s"], rel=1e-3)
    rows = run["requests"]
    assert [r["phase"] for r in rows] == [0, 0, 1, 1, 2, 2] and rows[0]["t_s"] == 0.0
    assert all(r["slo_met"] for r in rows)
    assert all(b["t_s"] >= a["t_s"] for a, b in zip(rows, rows[1:])) and run["start_wall"] > 0
    md = markdown(report, baseline="monolithic")
    assert "| auto | 40 | 1. image-heavy |" in md and "| auto | 40 | 3. mixed |" in md and "| auto | 40 | all |" in md
    run["events"] = [{"t_s": 0.01, "label": "d0 D -> E"}]
    report["events"] = [{"time": run["start_wall"] + 0.02, "label": "e0 E -> D"}, {"time": 1.0, "label": "before"}]
    events = events_of(run, report["events"])
    assert [label for _, label in events] == ["d0 D -> E", "e0 E -> D"] and events[1][0] == pytest.approx(0.02)
    json.dumps(report)  # JSON-ready as it stands
    paths = plot(report, tmp_path, "t")
    assert [p.name for p in paths] == ["t-shift.png", "t-shift-timeline.png"] and paths[1].stat().st_size > 10_000
