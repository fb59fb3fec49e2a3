"""`epdserve bench serve --backend openai --base-url URL` against epdserve's own HTTP front (real
scheduler, real engine instance, the official `openai` client), and the request shape it sends."""
import json

from epdserve.bench.openai_backend import chat_body, user_text
from epdserve.entrypoints.cli import main
from epdserve.perf.presets import PRESETS
from epdserve.perf.workload import build_workload
from tests.entrypoints.http_harness import RunningFront, metered_scheduler
from tests.scheduler.engine_instance import EngineInstance

WORKLOAD = ["--workload", "mixed", "--num-requests", "6", "--output-len", "4", "--output-len-std", "1",
            "--output-len-range", "3-5", "--request-rate", "inf", "--warmup", "1", "--no-progress"]


def test_requests_have_the_openai_chat_shape():
    reqs = build_workload(PRESETS["mixed"].with_(num_requests=8, seed=3))
    img = next(r for r in reqs if r.images)
    body = chat_body(img)
    parts = body["messages"][0]["content"]
    assert [p["type"] for p in parts] == ["image_url"] * len(img.images) + ["text"]
    assert parts[0]["image_url"]["url"].startswith("data:image/")
    assert "<|" not in parts[-1]["text"] and parts[-1]["text"] == user_text(img.prompt)
    assert body["max_completion_tokens"] == img.max_tokens and body["stream_options"] == {"include_usage": True}


def test_bench_serve_through_the_http_front(qwen2_vl_tiny, tmp_path):
    inst = EngineInstance(qwen2_vl_tiny, "bench-epd").start()
    sched, metrics = metered_scheduler(qwen2_vl_tiny, [inst])
    front = RunningFront(sched, metrics)
    try:
        out = tmp_path / "serve.json"
        assert main(["bench", "serve", "--backend", "openai", "--base-url", front.url, "--label", "http",
                     *WORKLOAD, "--out", str(out)]) == 0
    finally:
        front.stop()
        sched.stop()
        inst.stop()
    rep = json.loads(out.read_text())
    assert rep["targets"]["http"]["model"] == str(qwen2_vl_tiny)
    run = rep["workloads"]["mixed"]["modes"]["http"]["runs"][0]
    m = run["metrics"]
    assert (m["completed"], m["failed"], m["incomplete_outputs"]) == (6, 0, 0)
    assert m["ttft_ms"]["count"] == 6 and set(m["by_kind"]) == {"image", "text"}
    # incomplete_outputs == 0: every answer had its max_tokens (ignore_eos); usage came through
    assert all(r["ok"] and 3 <= r["output_tokens"] <= 5 and r["prompt_tokens"] > 0 for r in run["requests"])
