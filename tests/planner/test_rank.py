"""Ranking: candidates that fit, order, and monotone in load on the real profile."""
from dataclasses import replace

from epdserve.instance.modes import MODES
from epdserve.planner.costs import CostModel
from epdserve.planner.deployment import splits
from epdserve.planner.rank import predict, rank
from epdserve.planner.shapes import shapes_from_trace

from .conftest import PROFILE, SERVE


def test_splits_fit_the_devices():
    for mode in MODES:
        for n in (1, 2, 4):
            cands = splits(mode, n)
            assert all(d.num_instances <= n for d in cands)
            assert len({(d.encode, d.prefill, d.decode) for d in cands}) == len(cands)
        assert splits(mode, 2, colocated_host=True)  # every mode runs on the host, whatever N
    assert [d.summary for d in splits("E-P-D", 3)] == ["Ex1,Px1,Dx1"]
    assert not splits("E-P-D", 2)
    assert {d.summary for d in splits("monolithic", 2)} == {"EPDx1", "EPDx2"}


def test_ranking_is_sorted_and_monotone_in_load():
    costs, _ = CostModel.load(PROFILE)
    base = shapes_from_trace(SERVE)[:20]
    attain = {}
    for speed in (0.25, 1.0, 4.0):  # the same requests, arrivals compressed: more load
        shapes = [replace(s, arrival_s=s.arrival_s / speed) for s in base]
        preds = rank(costs, shapes, devices=2, colocated_host=True)
        good = [p.metrics["good_requests"] for p in preds]
        assert good == sorted(good, reverse=True)
        for p in preds:
            attain.setdefault(p.deployment, []).append(p.metrics["slo_attainment"])
    for dep, values in attain.items():
        assert values == sorted(values, reverse=True), (dep, values)
    assert any(v[0] > v[-1] for v in attain.values())  # the highest load does hurt


def test_more_devices_never_predict_less_for_the_best_plan():
    costs, _ = CostModel.load(PROFILE)
    shapes = [replace(s, arrival_s=s.arrival_s / 4) for s in shapes_from_trace(SERVE)[:20]]
    best = [rank(costs, shapes, devices=n, modes=("monolithic", "E-PD"))[0] for n in (1, 2)]
    assert best[1].goodput >= best[0].goodput
    one = predict(best[0].deployment, costs, shapes)
    assert one.metrics == best[0].metrics  # deterministic


def test_devices_are_counted_per_rank_at_the_stage_degrees():
    """An instance of degree N takes N devices: a P TP2 + D TP1 pair needs three, TP2 monoliths two each."""
    from epdserve.planner.deployment import StageDegrees

    p2 = StageDegrees(prefill=2)
    assert [(d.summary, d.devices_used) for d in splits("P-D", 3, degrees=p2)] == [("P+Ex1,Dx1", 3)]
    assert splits("P-D", 2, degrees=p2) == [] and splits("P-D", 2) != []
    assert {(d.summary, d.devices_used) for d in splits("monolithic", 4, degrees=StageDegrees(lm=2))} == \
        {("EPDx1", 2), ("EPDx2", 4)}
    e_p_d = splits("E-P-D", 8, degrees=StageDegrees(prefill=2, decode=4))[0]
    assert e_p_d.instance_degrees() == [1, 2, 4] and e_p_d.devices_used == 7
    assert e_p_d.launch_config()["decode_tensor_parallel_size"] == 4
    # on one shared host a pool's ranks are bounded by the core groups
    assert {d.summary for d in splits("P-D", 2, colocated_host=True, degrees=p2)} == {"P+Ex1,Dx1", "P+Ex1,Dx2"}


def test_each_instance_steps_at_its_own_degrees_costs():
    """Costs per degree: in an E-P-D whose decode pool runs at TP2, the D instance's workers step at
    the TP2 profile's costs and the E and P ones at TP1's; a degree without a profile is refused
    naming the command that measures it."""
    import pytest

    from epdserve.planner.costs import Curve
    from epdserve.planner.deployment import PlannedDeployment, StageDegrees
    from epdserve.planner.simulate import Simulation

    costs, _ = CostModel.load(PROFILE)
    faster = replace(costs, decode=Curve(costs.decode.xs, tuple(y / 2 for y in costs.decode.ys)))
    sim = Simulation(PlannedDeployment("E-P-D", 1, 1, 1, degrees=StageDegrees(decode=2)), {1: costs, 2: faster})
    assert [w.costs for w in sim.decoders] == [faster]
    assert [w.costs for w in sim.encoders + sim.prefillers] == [costs, costs]
    one = Simulation(PlannedDeployment("E-P-D", 1, 1, 1), {1: costs, 2: faster})
    assert all(w.costs is costs for w in one.encoders + one.prefillers + one.decoders)
    predict(PlannedDeployment("E-P-D", 1, 1, 1, degrees=StageDegrees(decode=2)), {1: costs, 2: faster},
            shapes_from_trace(SERVE)[:10])  # and it runs
    with pytest.raises(ValueError, match="no profile at tensor_parallel_size 2 .*--tensor-parallel-size 2"):
        Simulation(PlannedDeployment("E-P-D", 1, 1, 1, degrees=StageDegrees(decode=2)), {1: costs})
