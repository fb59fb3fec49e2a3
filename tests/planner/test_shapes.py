"""Workload shapes: a preset counted on a checkpoint is the recorded run's requests."""
import json

import pytest

from epdserve.planner.shapes import WorkloadError, shapes_from_preset, shapes_from_run, shapes_from_trace

from .conftest import SERVE


def test_preset_matches_the_recorded_run_of_the_same_workload(qwen2_vl_tiny):
    """Same ids, arrivals, vision tokens and output lengths as the server recorded. (Text token
    counts need the served checkpoint's tokenizer; the tiny demo's differs by a token or two.)"""
    data = json.loads(SERVE.read_text())
    name, entry = next(iter(data["workloads"].items()))
    run = next(iter(entry["modes"].values()))["runs"][0]
    recorded = shapes_from_run(run)
    counted = shapes_from_preset(name, run["rate"], str(qwen2_vl_tiny), num_requests=entry["config"]["num_requests"],
                                 burstiness=run["burstiness"], seed=run["seed"])
    assert [s.request_id for s in counted] == [s.request_id for s in recorded]
    assert [s.arrival_s for s in counted] == pytest.approx([s.arrival_s for s in recorded])
    assert [s.vision_tokens for s in counted] == [s.vision_tokens for s in recorded]
    assert [len(s.vision_items) for s in counted] == [len(s.vision_items) for s in recorded]
    assert [s.output_tokens for s in counted] == [s.output_tokens for s in recorded]


def test_trace_selection_and_errors(tmp_path):
    shapes = shapes_from_trace(SERVE)
    assert shapes and all(s.prompt_tokens >= s.vision_tokens for s in shapes)
    with pytest.raises(WorkloadError, match="no workload 'nope'"):
        shapes_from_trace(SERVE, workload="nope")
    with pytest.raises(WorkloadError, match="no run at rate 123"):
        shapes_from_trace(SERVE, rate=123.0)
    (tmp_path / "p.json").write_text(json.dumps({"benchmark": "profile"}))
    with pytest.raises(WorkloadError, match="not an `epdserve bench serve` results file"):
        shapes_from_trace(tmp_path / "p.json")
