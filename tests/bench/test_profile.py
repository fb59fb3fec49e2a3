"""`epdserve profile` on the tiny model: every stage measured, bytes consistent with the model's shape."""
import json

import pytest

from epdserve.entrypoints.cli import main
from epdserve.perf.profile_report import interp
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
    assert est[2]["ttft_ms"] > rep["vision"][1]["encode_ms"] and est[0]["prompt_tokens"] == 10


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
