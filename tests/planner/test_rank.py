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
