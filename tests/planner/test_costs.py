"""The cost model against the real `epdserve profile` report of the small demo model."""
import json

import pytest

from epdserve.planner.costs import CostModel, ProfileError

from .conftest import PROFILE


def test_measured_points_are_reproduced_and_interpolated():
    costs, report = CostModel.load(PROFILE)
    for v in report["vision"]:
        assert costs.encode_ms(v["vision_tokens"]) == pytest.approx(v["encode_ms"])
        assert costs.preprocess_ms(v["vision_tokens"]) == pytest.approx(v["preprocess_ms"])
    for p in report["prefill"]:
        assert costs.prefill_ms(p["prompt_tokens"]) == pytest.approx(p["prefill_ms"])
    for d in report["decode"]:
        assert costs.decode_ms(d["batch_size"]) == pytest.approx(d["decode_ms_per_step"])
    (x0, y0), (x1, y1) = [(v["vision_tokens"], v["encode_ms"]) for v in report["vision"][:2]]
    mid = (x0 + x1) / 2
    assert costs.encode_ms(mid) == pytest.approx((y0 + y1) / 2)
    # past the last point: the last segment's slope continues
    (xa, ya), (xb, yb) = [(p["prompt_tokens"], p["prefill_ms"]) for p in report["prefill"][-2:]]
    assert costs.prefill_ms(2 * xb) == pytest.approx(yb + (yb - ya) / (xb - xa) * xb)
    assert costs.encode_ms(0) == 0.0 and costs.decode_ms(0) == 0.0


def test_bytes_and_transfer_time_come_from_the_profile():
    costs, report = CostModel.load(PROFILE, link_gbps=2.0, link_latency_ms=0.5)
    per_tok = sum(v["feature_bytes"] for v in report["vision"]) / sum(v["vision_tokens"] for v in report["vision"])
    assert costs.feature_bytes_per_token == pytest.approx(per_tok)
    assert costs.kv_bytes_per_token == report["kv_bytes_per_token"]
    assert costs.kv_transfer_ms(100) == pytest.approx(0.5 + 100 * report["kv_bytes_per_token"] / 2e9 * 1e3)
    assert costs.transfer_ms(0) == 0.0


def test_a_missing_or_foreign_file_is_refused_clearly(tmp_path):
    with pytest.raises(ProfileError, match="not found"):
        CostModel.load(tmp_path / "nope.json")
    (tmp_path / "x.json").write_text(json.dumps({"benchmark": "serve"}))
    with pytest.raises(ProfileError, match="not an `epdserve profile` report"):
        CostModel.load(tmp_path / "x.json")
    (tmp_path / "y.json").write_text(json.dumps({"benchmark": "profile", "vision": []}))
    with pytest.raises(ProfileError, match="not an `epdserve profile` report"):
        CostModel.load(tmp_path / "y.json")
