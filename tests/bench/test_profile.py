"""`epdserve profile` on the tiny model: every stage measured, bytes consistent with the model's shape."""
import json

import pytest

from epdserve.entrypoints.cli import main
from epdserve.perf.profile_report import cost_at, interp, unloaded_ttft
from epdserve.perf.profiler import parse_resolution, run_profile


def test_profile_reports_every_stage_with_consistent_bytes(qwen2_vl_tiny):
    rep = run_profile(qwen2_vl_tiny, "cpu", ["56x56", "224x224"], [16, 64], [1, 3], repeats=1, decode_steps=2,
                      decode_context=8, text_tokens=10)
    info = rep["model_info"]
    assert [v["vision_tokens"] for v in rep["vision"]] == [4, 64]  # 14 px patches, 2x2 merge
    for v in rep["vision"]:
        assert v["encode_ms"] > 0 and v["preprocess_ms"] > 0
        assert v["feature_bytes"] == v["vision_tokens"] * info["hidden"] * 4  # fp32 on CPU
    assert [p["prompt_tokens"] for p in rep["prefill"]] == [16, 64] and all(p["prefill_ms"] > 0 for p in rep["prefill"])
    assert [d["batch_size"] for d in rep["decode"]] == [1, 3]
    assert all(d["decode_tokens_per_s"] == pytest.approx(d["batch_size"] / d["decode_ms_per_step"] * 1e3)
               for d in rep["decode"])
    kv_tok = 2 * info["layers"] * info["kv_heads"] * info["head_dim"] * 4
    assert rep["kv_bytes_per_token"] == kv_tok
    assert rep["per_request"][0] == {"resolution": "text-only", "prompt_tokens": 10, "feature_bytes": 0,
                                     "kv_bytes": 10 * kv_tok}
    assert rep["per_request"][2]["kv_bytes"] == (64 + 10) * kv_tok
    est = rep["unloaded_ttft"]
    assert [u["request"] for u in est] == ["text-only", "1 x 56x56", "1 x 224x224"]
    assert [u["prompt_tokens"] for u in est] == [10, 4 + 10, 64 + 10]
    assert est[0]["preprocess_ms"] == est[0]["encode_ms"] == 0.0
    for u, v in zip(est[1:], rep["vision"]):  # each image row's parts are that size's measured figures
        assert (u["preprocess_ms"], u["encode_ms"]) == (v["preprocess_ms"], v["encode_ms"])
    xs, ys = [p["prompt_tokens"] for p in rep["prefill"]], [p["prefill_ms"] for p in rep["prefill"]]
    for u in est:
        assert u["prefill_ms"] == cost_at(xs, ys, u["prompt_tokens"]) >= 0.0
        assert u["ttft_ms"] == pytest.approx(u["preprocess_ms"] + u["encode_ms"] + u["prefill_ms"])


def test_unloaded_ttft_never_extrapolates_prefill_below_zero():
    """Two noisy prefill points whose line crosses zero above the shortest prompt (CI once saw it:
    an estimated TTFT smaller than the encode it includes): the prefill part is clamped at 0."""
    report = {"prefill": [{"prompt_tokens": 16, "prefill_ms": 2.0}, {"prompt_tokens": 64, "prefill_ms": 30.0}],
              "vision": [{"resolution": "112x112", "vision_tokens": 32, "preprocess_ms": 1.5, "encode_ms": 7.0}],
              "text_tokens_per_request": 2}
    rows = unloaded_ttft(report)
    assert interp([16, 64], [2.0, 30.0], 2) < 0  # the bare line goes negative there
    assert [r["prefill_ms"] for r in rows] == [0.0, interp([16, 64], [2.0, 30.0], 34)]
    assert rows[1]["prefill_ms"] > 0 and rows[1]["ttft_ms"] == pytest.approx(1.5 + 7.0 + rows[1]["prefill_ms"])
    assert rows[0]["ttft_ms"] == 0.0


def test_cost_at_is_zero_at_and_below_zero_size():
    assert cost_at([10, 20], [5.0, 6.0], 0) == 0.0 and cost_at([10, 20], [5.0, 6.0], -3) == 0.0
    assert cost_at([10, 20], [1.0, 2.0], 15) == pytest.approx(1.5)


def test_interp_is_piecewise_linear():
    assert interp([10, 20, 40], [1.0, 2.0, 6.0], 30) == pytest.approx(4.0)
    assert interp([10, 20], [1.0, 2.0], 40) == pytest.approx(4.0)  # extended past the end
    assert interp([10, 20], [1.0, 2.0], 5) == pytest.approx(0.5)
    assert interp([10], [3.0], 20) == pytest.approx(6.0)


def test_profile_cli_writes_json(qwen2_vl_tiny, tmp_path, capsys):
    out = tmp_path / "p.json"
    rc = main(["profile", "--model", str(qwen2_vl_tiny), "--resolutions", "56x56", "--prompt-lens", "8",
               "--batch-sizes", "2", "--repeats", "1", "--decode-steps", "2", "--out", str(out)])
    assert rc == 0
    rep = json.loads(out.read_text())
    assert rep["benchmark"] == "profile" and len(rep["vision"]) == len(rep["prefill"]) == len(rep["decode"]) == 1
    assert "| decode batch |" in capsys.readouterr().out


def test_parse_resolution():
    assert parse_resolution("720p") == ("720p", 1280, 720) and parse_resolution("30x20") == ("30x20", 30, 20)
    with pytest.raises(ValueError):
        parse_resolution("big")
