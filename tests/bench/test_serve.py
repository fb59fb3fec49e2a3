"""bench serve without a server: the runner against a scripted backend, the report, the launcher."""
import argparse
import json
import math
import sys
import threading
import time
from types import SimpleNamespace

import pytest

from epdserve.bench.report import latency_summary, markdown, plot
from epdserve.bench.serve import add_parser, parse_rates, run_target, workload_configs
from epdserve.deploy.local.launched import LaunchError, launched, parse_ready
from epdserve.bench.serve_runner import RunConfig, fields_of, run_requests, send_one
from epdserve.perf.arrivals import arrival_times
from epdserve.perf.serving_metrics import SLO
from epdserve.perf.workload import WorkloadConfig, build_workload

TINY = WorkloadConfig(name="tiny", num_requests=6, resolution_scale=0.05, output_len_mean=3, output_len_std=0,
                      output_len_min=3, output_len_max=3, text_only_share=0.5, text_prompt_words_mean=5,
                      text_prompt_words_std=0)


class FakeBackend:
    """Streams max_tokens one-token deltas, then a usage-only last message with stage timestamps."""

    def __init__(self, gap=0.002, fail_ids=(), abort_ids=()):
        self.gap, self.fail_ids, self.abort_ids = gap, set(fail_ids), set(abort_ids)
        self.lock = threading.Lock()
        self.in_flight = self.max_in_flight = 0
        self.seen = []

    def stream(self, req):
        with self.lock:
            self.in_flight += 1
            self.max_in_flight = max(self.max_in_flight, self.in_flight)
            self.seen.append(req.request_id)
        try:
            if req.request_id in self.fail_ids:
                raise RuntimeError("instance died")
            arrival = time.time()
            for i in range(req.max_tokens):
                time.sleep(self.gap)
                yield SimpleNamespace(token_ids=[7], finished=False)
            n_img = len(req.images)
            timing = {"arrival": arrival, "dispatched": arrival, "encode_start": arrival if n_img else 0.0,
                      "encode_end": arrival + 0.001 if n_img else 0.0, "prefill_start": arrival + 0.001,
                      "first_token": arrival + self.gap}
            yield SimpleNamespace(token_ids=[], finished=True,
                                  finish_reason="abort" if req.request_id in self.abort_ids else "length",
                                  usage={"prompt_tokens": 10 + 4 * n_img, "prompt_text_tokens": 10,
                                         "vision_tokens": 4 * n_img, "cached_vision_tokens": 0,
                                         "output_tokens": req.max_tokens},
                                  timing=SimpleNamespace(**timing))
        finally:
            with self.lock:
                self.in_flight -= 1


def test_send_one_records_tokens_usage_and_timestamps():
    req = build_workload(TINY.with_(text_only_share=0.0))[0]
    rec = send_one(FakeBackend(), req)
    assert rec.success and rec.chunk_tokens == [1, 1, 1] and rec.n_out == 3
    assert (rec.vision_tokens, rec.prompt_text_tokens, rec.kind) == (4, 10, "image")
    assert rec.timing["encode_start"] > 0 and rec.end >= rec.chunk_times[-1] > rec.t0


def test_failures_and_aborts_are_recorded_not_raised():
    reqs = build_workload(TINY)
    backend = FakeBackend(fail_ids={reqs[1].request_id}, abort_ids={reqs[2].request_id})
    recs = run_requests(backend, reqs, RunConfig(progress=False))
    assert [r.request_id for r in recs] == [r.request_id for r in reqs]
    assert [r.success for r in recs] == [True, False, False, True, True, True]
    assert "instance died" in recs[1].error and "abort" in recs[2].error


def test_closed_loop_respects_max_concurrency():
    backend = FakeBackend(gap=0.005)
    recs = run_requests(backend, build_workload(TINY.with_(num_requests=10)), RunConfig(max_concurrency=2, progress=False))
    assert len(recs) == 10 and all(r.success for r in recs)
    assert backend.max_in_flight <= 2


def test_open_loop_never_sends_before_its_arrival_time():
    reqs = build_workload(TINY.with_(num_requests=5))
    cfg = RunConfig(rate=20.0, seed=4, progress=False)
    before = time.monotonic()
    recs = run_requests(FakeBackend(gap=0.001), reqs, cfg)
    offsets = arrival_times(5, 20.0, 1.0, seed=4)
    assert offsets[-1] > 0
    for rec, off in zip(recs, offsets):
        assert rec.t0 >= before + off


def test_fields_of_reads_dicts_objects_and_skips_missing():
    assert fields_of({"a": 1}, ("a", "b")) == {"a": 1}
    assert fields_of(SimpleNamespace(a=2), ("a", "b")) == {"a": 2}
    assert fields_of(None, ("a",)) == {}


def _args(**kw):
    p = argparse.ArgumentParser()
    add_parser(p.add_subparsers())
    return p.parse_args(["serve", "--no-progress", "--warmup", "1", *kw.pop("argv", [])])


def test_run_target_report_markdown_and_plots(tmp_path):
    args = _args(argv=["--workload", "mixed", "--num-requests", "6", "--resolution-scale", "0.05", "--output-len", "3",
                       "--output-len-std", "0", "--output-len-range", "3-3"])
    workloads = workload_configs(args)
    assert workloads[0].text_only_share == 0.5 and workloads[0].num_requests == 6
    slo = SLO(ttft_ms=1000, tpot_ms=500)
    report = {"slo": slo.to_dict(), "workloads": {}}
    saves = []
    for label, gap in (("monolithic", 0.004), ("E-PD", 0.002)):
        run_target(FakeBackend(gap=gap), label, workloads, "inf,50", args, slo, report, lambda: saves.append(1))
    w = report["workloads"]["mixed"]
    assert list(w["modes"]) == ["monolithic", "E-PD"] and len(saves) == 4
    run = w["modes"]["E-PD"]["runs"][0]
    assert run["metrics"]["completed"] == 6 and len(run["requests"]) == 6
    assert set(run["metrics"]["by_kind"]) == {"image", "text"}
    # each rate of a sweep gets fresh images; every target gets the same requests
    runs = w["modes"]["monolithic"]["runs"]
    assert runs[0]["seed"] != runs[1]["seed"] and runs[1]["seed"] == w["modes"]["E-PD"]["runs"][1]["seed"]
    md = markdown(report, baseline="monolithic")
    assert "| E-PD | inf | 6/0 |" in md and "text TTFT p50" in md and "Highest rate meeting" in md
    assert "| monolithic | inf |" in md and "1.00x" in md
    assert "E->P / P queue" in md  # stage split from the server timestamps
    # TPOT p50/p90/p99 over requests and ITL p99 over all gaps, in the table as in the JSON
    head = next(line for line in md.splitlines() if line.startswith("| mode | rate | ok/fail"))
    cols = [c.strip() for c in head.strip("|").split("|")]
    row = next(line for line in md.splitlines() if line.startswith("| E-PD | inf |"))
    cells = dict(zip(cols, (c.strip() for c in row.strip("|").split("|"))))
    m = run["metrics"]
    for col, key, q in (("TPOT p50", "tpot_ms", "p50"), ("TPOT p90", "tpot_ms", "p90"), ("TPOT p99", "tpot_ms", "p99"),
                        ("ITL p99", "itl_ms", "p99")):
        assert cells[col] == f"{m[key][q]:.1f}"
    assert all(r["itl_max_ms"] is not None for r in run["requests"])
    assert latency_summary(m) == (f"TPOT p50/p90/p99 {m['tpot_ms']['p50']:.1f}/{m['tpot_ms']['p90']:.1f}/"
                                  f"{m['tpot_ms']['p99']:.1f} ms, ITL p99 {m['itl_ms']['p99']:.1f} ms")
    json.dumps(report, default=str)  # JSON-ready
    paths = plot(report, tmp_path, "t")
    assert [p.name for p in paths] == ["t-mixed.png"] and paths[0].stat().st_size > 10_000


def test_markdown_shows_a_mode_that_failed_to_launch():
    report = {"slo": SLO().to_dict(), "workloads": {"w": {"summary": "s", "modes": {
        "E-P-D": {"runs": [], "error": "launch --mode E-P-D exited with 1"}}}}}
    assert "failed: launch --mode E-P-D exited with 1" in markdown(report)


def test_parse_rates_and_ready_lines():
    assert parse_rates("0.5,1,inf") == [0.5, 1.0, math.inf]
    assert parse_rates("preset", "mixed") == [0.5, 1.0] and parse_rates("preset", "custom") == [math.inf]
    with pytest.raises(SystemExit):
        parse_rates("0")
    line = "epdserve ready: grpc://127.0.0.1:5123 mode=E-PD instances=Ex1,PDx1 mm_store=redis://127.0.0.1:6400"
    assert parse_ready(line, "x") == "127.0.0.1:5123"
    assert parse_ready("epdserve ready: grpc://0.0.0.0:7001 mode=EP-D", "x") == "127.0.0.1:7001"
    assert parse_ready("epdserve ready", "127.0.0.1:9") == "127.0.0.1:9"
    assert parse_ready("epdserve scheduler ready: s1 grpc://127.0.0.1:5000", "x") is None  # a child's line
    assert parse_ready("waiting until instances are ready", "x") is None


def test_launcher_waits_for_ready_and_stops_the_child(tmp_path):
    script = "import os,sys,time; print('loading', os.environ['BENCH_X']); print('epdserve ready: grpc://127.0.0.1:{port} mode=fake', flush=True); time.sleep(60)"
    with launched("fake", "m", argv=[sys.executable, "-c", script], log_dir=str(tmp_path), port=45678,
                  env={"BENCH_X": "42"}) as dep:
        assert dep.address == "127.0.0.1:45678" and dep.ready_s >= 0
        pid = dep.pid
    import os

    with pytest.raises(ProcessLookupError):
        os.kill(pid, 0)  # gone (reaped)
    assert "loading 42" in open(dep.log_path).read()


def test_launcher_reports_an_early_exit_with_its_output(tmp_path):
    script = "import sys; print('bad flag --mode'); sys.exit(2)"
    with pytest.raises(LaunchError, match="(?s)exited with 2.*bad flag"):
        with launched("fake", "m", argv=[sys.executable, "-c", script], log_dir=str(tmp_path)):
            pass


def test_multi_image_and_upload_then_ask_workloads():
    from epdserve.bench.upload_ask import UploadAskConfig, spread

    multi, upload = workload_configs(_args(argv=["--workload", "multi-image,upload-then-ask", "--num-requests", "3",
                                                 "--think-time-s", "0.5", "--output-len", "5"]))
    assert (multi.images_min, multi.images_max, multi.resolution_scale, multi.num_requests) == (4, 4, 1.0, 3)
    assert dict(multi.resolution_mix) == {"360p": 1.0}
    assert isinstance(upload, UploadAskConfig)
    assert (upload.num_requests, upload.think_time_s, upload.max_tokens, upload.width, upload.height) == \
        (3, 0.5, 5, 640, 360)
    assert spread([10.0, 20.0, 30.0, 40.0, 50.0]) == {"n": 5, "p25": 20.0, "median": 30.0, "p75": 40.0,
                                                       "min": 10.0, "max": 50.0}
    assert spread([])["median"] is None
