"""The budget-policy benchmark (epdserve/bench/budget_policy.py): its variants parse as documented
and a bad one is refused by name, its workload is the documented mix, and one real engine's run
yields a complete record per request (every token timed, none lost) that the serving metrics read."""
from __future__ import annotations

import math

import pytest

from epdserve.bench.budget_policy import (Load, Variant, build_engine, parse_loads, parse_variants, run_once, table,
                                          workload)
from epdserve.perf.serving_metrics import compute_metrics
from epdserve.slo import SLO


def test_variants_parse_and_a_bad_one_is_named():
    assert parse_variants("default, h32b8=32/8,nb=off") == [Variant("default"), Variant("h32b8", horizon=32, bank=8.0),
                                                            Variant("nb", budget=False)]
    with pytest.raises(ValueError, match="'x=32'"):
        parse_variants("x=32")
    with pytest.raises(ValueError, match="repeat"):
        parse_variants("a,a=off")


def test_loads_parse_and_a_bad_one_is_named():
    assert parse_loads("1, inf,c4") == [Load("1/s", 1.0), Load("inf/s", math.inf), Load("c4", math.inf, 4)]
    for bad in ("c0", "0", "fast"):
        with pytest.raises(ValueError, match=repr(bad)):
            parse_loads(bad)


def test_the_workload_mixes_images_and_spaces_arrivals():
    reqs = workload(6, 0.5, 8, 2.0)
    assert [off for off, *_ in reqs] == [0.0, 0.5, 1.0, 1.5, 2.0, 2.5]
    assert [len(imgs) for _, _, imgs, _ in reqs] == [0, 1, 0, 1, 0, 1]
    assert [imgs[0].size for _, _, imgs, _ in reqs if imgs] == [(320, 180), (480, 270), (640, 360)]
    assert len({p for _, p, _, _ in reqs}) == 6 and all(off == 0.0 for off, *_ in workload(3, 0.0, 8, math.inf))
    assert {m for *_, m in reqs} == {8} and sorted(m for *_, m in workload(10, 0.5, 8, 2.0, spread=0.5)) == [
        4, 5, 6, 7, 8, 8, 9, 10, 11, 12]  # spread evenly over 8 x (1 +- 0.5)
    other = workload(6, 0.5, 8, 2.0, seed=1)  # another round: nothing an engine's caches could reuse
    assert not {p for _, p, _, _ in reqs} & {p for _, p, _, _ in other}
    assert reqs[1][2][0].tobytes() != other[1][2][0].tobytes()


def test_one_engine_run_times_every_token(qwen2_vl_tiny):
    eng = build_engine(str(qwen2_vl_tiny), "float32", Variant("h4b3", horizon=4, bank=3.0), 100.0)
    assert (eng.budget.horizon, eng.budget.max_step_s) == (4, pytest.approx(3 * eng.budget.target_s))
    records = run_once(eng, workload(4, 0.5, 5, math.inf), "t")
    assert all(r.success for r in records) and [r.n_out for r in records] == [5] * 4
    assert all(sum(r.chunk_tokens) == 5 and len(r.chunk_times) == 5 for r in records)  # one message a token
    m = compute_metrics(records, SLO(), by_kind=False)
    assert m["completed"] == 4 and m["itl_ms"]["count"] == 4 * 4
    assert "| inf/s | h4b3 |" in "\n".join(table({"h4b3": {"inf/s": [m]}}, parse_loads("inf")))
    closed = sorted(run_once(eng, workload(3, 0.0, 3, math.inf), "c", concurrency=1), key=lambda r: r.t0)
    assert all(later.t0 >= earlier.end for earlier, later in zip(closed, closed[1:]))  # one in flight at a time
    assert build_engine(str(qwen2_vl_tiny), "float32", Variant("nb", budget=False), 100.0).budget is None
