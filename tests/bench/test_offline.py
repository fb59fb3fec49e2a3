"""`epdserve bench offline` end to end on the tiny demo model with tiny workloads: JSON structure and sanity.

No timer is asserted: only token counts, the presence of every configuration, positive ratios,
the engine's time split and the greedy-match bookkeeping.
"""
import json

import pytest

from epdserve.bench.offline import main
from epdserve.bench.offline_configs import cb_sizes
from epdserve.bench.offline_workloads import WorkloadSpec, build_requests

N, OUT, SUBSET = 3, 3, 2


@pytest.fixture(scope="module")
def report(qwen2_vl_tiny, tmp_path_factory):
    out = tmp_path_factory.mktemp("bench") / "offline.json"
    rc = main(["--model", str(qwen2_vl_tiny), "--workload", "all", "--num-requests", str(N), "--output-len", str(OUT),
               "--baseline-requests", str(SUBSET), "--image-size", "112", "--max-prompt-len", "120",
               "--threads", "1", "--out", str(out)])
    assert rc == 0
    return json.loads(out.read_text())


@pytest.mark.slow
def test_every_configuration_ran_with_equal_output_counts(report):
    expected = {"text": {"engine", "engine_portable", "one_at_a_time", "padded", "generate_batch"},
                "images": {"engine", "engine_portable", "one_at_a_time", "padded"}}
    assert set(report["workloads"]) == set(expected)
    for name, w in report["workloads"].items():
        assert set(w["configs"]) == expected[name]
        for cfg, c in w["configs"].items():
            n = SUBSET if cfg == "one_at_a_time" else N
            assert c["num_requests"] == n and c["subset"] == (n < N)
            assert c["output_tokens"] == n * OUT
            assert c["prompt_tokens"] > 0 and c["output_tok_s"] > 0 and c["total_tok_s"] > c["output_tok_s"]
            assert c["peak_rss_mib"] > 0
        full = [c for c in w["configs"].values() if not c["subset"]]
        assert len({(c["prompt_tokens"], c["vision_tokens"]) for c in full}) == 1  # same inputs everywhere


@pytest.mark.slow
def test_vision_tokens_and_engine_split(report):
    text, images = report["workloads"]["text"], report["workloads"]["images"]
    assert all(c["vision_tokens"] == 0 for c in text["configs"].values())
    assert images["configs"]["engine"]["vision_tokens"] == N * 16  # 112² → 8×8 patches → 16 after the 2×2 merge
    s = images["engine_split"]
    assert s["images_encoded"] == N and s["vision_s"] > 0 and s["prefill_s"] > 0 and 0 < s["vision_share"] < 1
    assert text["engine_split"]["images_encoded"] == 0 and text["engine_split"]["vision_share"] == 0
    for w in (text, images):
        h = w["engine_split"]["host_ms_per_step"]
        assert h["host"] > 0 and h["forward"] > 0
        assert h["host"] == pytest.approx(h["schedule"] + h["inputs"] + h["update"])
        assert w["engine_split"]["decode_host_ms_per_step"] > 0
    assert "Per step: host (Python)" in report["markdown"]


@pytest.mark.slow
def test_ratios_aims_and_token_match(report):
    for name, w in report["workloads"].items():
        assert set(w["engine_speedup"]) == set(w["configs"]) - {"engine"}
        assert all(r > 0 for r in w["engine_speedup"].values())
        assert set(w["aims"]) <= set(w["engine_speedup"]) and w["aims"]
        match = w["token_match_vs_one_at_a_time"]
        assert all(m["compared"] == SUBSET for m in match.values())
        # the engine (fp32, greedy, native or portable operators) equals one-at-a-time `generate` exactly;
        # the batched baselines' counts are only reported (left padding changes their fp32 sums)
        assert match["engine"]["matched"] == match["engine_portable"]["matched"] == SUBSET, match
    assert "| epdserve engine" in report["markdown"] and "Engine time split" in report["markdown"]


def test_workloads_are_seeded_and_in_range(qwen2_vl_tiny):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(qwen2_vl_tiny)
    spec = WorkloadSpec("text", 16, 4, seed=3, min_prompt_len=50, max_prompt_len=400)
    a, b = build_requests(spec, tok), build_requests(spec, tok)
    assert [r.prompt for r in a] == [r.prompt for r in b]
    assert all(50 <= len(r.prompt) <= 400 and not r.images for r in a)
    imgs = build_requests(WorkloadSpec("images", 2, 4, image_size=112), tok)
    assert all(len(r.images) == 1 and r.prompt.count("<|image_pad|>") == 1 for r in imgs)
    assert imgs[0].images != imgs[1].images


def test_cb_sizes_fit_every_request():
    s = cb_sizes([50, 400], 128, page_size=32, max_batch_tokens=2048)
    assert s["num_blocks"] >= (50 + 128 + 31) // 32 + (400 + 128 + 31) // 32
    assert s["page_size"] == 32 and s["max_batch_tokens"] == 2048


def test_registered_in_cli():
    from epdserve.entrypoints.cli import build_parser

    args = build_parser().parse_args(["bench", "offline", "--workload", "text", "--baseline-requests", "4"])
    assert args.workload == "text" and args.baseline_requests == 4 and callable(args.func)


def test_summary_takes_medians_over_repeats():
    from epdserve.bench.offline_report import summarize_workload

    def run(cfg, seconds, tokens):
        return {"config": cfg, "num_requests": 2, "duration_s": seconds, "cpu_s": seconds, "loadavg_1m": [0.5, 0.6],
                "prompt_tokens": 100, "vision_tokens": 0, "output_tokens": 8, "tokens": tokens,
                "peak_rss_bytes": 2**20, "extra": {}}

    same, other = [[1, 2, 3, 4]] * 2, [[1, 2, 3, 4], [9, 9, 9, 9]]
    runs = {"engine": [run("engine", s, same) for s in (1.0, 5.0, 2.0)],
            "one_at_a_time": [run("one_at_a_time", s, other) for s in (4.0, 8.0, 3.0)]}
    w = summarize_workload("text", runs, total_requests=2)
    assert w["configs"]["engine"]["duration_s"] == 2.0 and w["configs"]["engine"]["output_tok_s"] == 4.0
    assert w["engine_speedup"]["one_at_a_time"] == 2.0
    assert w["configs"]["engine"]["best_s"] == 1.0 and w["engine_speedup_best"]["one_at_a_time"] == 3.0
    assert w["aims"]["one_at_a_time"] == {"aim": 5.0, "measured": 2.0, "met": False}
    assert w["token_match_vs_one_at_a_time"]["engine"] == {"matched": 1, "compared": 2}


def test_engine_split_reports_host_time_per_step():
    from epdserve.bench.offline_report import engine_split

    stats = {"vision_s": 0.0, "prefill_s": 1.0, "decode_s": 3.0, "steps": 10, "decode_steps": 8,
             "host_s": 0.05, "schedule_s": 0.01, "inputs_s": 0.02, "update_s": 0.02, "forward_s": 3.9,
             "decode_host_s": 0.032, "decode_forward_s": 2.9}
    s = engine_split({"duration_s": 5.0, "extra": {"engine_stats": stats}})
    assert s["host_ms_per_step"] == pytest.approx({"host": 5.0, "schedule": 1.0, "inputs": 2.0, "update": 2.0,
                                                   "forward": 390.0})
    assert s["decode_host_ms_per_step"] == pytest.approx(4.0) and s["decode_forward_ms_per_step"] == pytest.approx(362.5)
    empty = engine_split({"duration_s": 1.0, "extra": {}})
    assert empty["host_ms_per_step"]["host"] == 0.0 and empty["decode_host_ms_per_step"] == 0.0
