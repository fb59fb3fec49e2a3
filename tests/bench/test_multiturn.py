"""bench serve --workload multiturn without a server: the closed loop per conversation, the per-turn
report, the benchmark's targets and on/off ratios (a scripted backend and synthetic reports)."""
import argparse
import shlex
import threading
import time
from types import SimpleNamespace

import pytest

from epdserve.bench.multiturn_bench import QUICK, bench_argv, parser, targets
from epdserve.bench.multiturn_compare import PAIRS, pair_rows, pair_table, target_table
from epdserve.bench.multiturn_runner import run_conversations
from epdserve.bench.openai_backend import chat_body
from epdserve.bench.report import markdown
from epdserve.bench.serve import add_parser, run_target, workload_configs
from epdserve.bench.serve_runner import RunConfig
from epdserve.perf.multiturn import MultiturnConfig, build_conversations
from epdserve.perf.serving_metrics import SLO

TINY = MultiturnConfig(conversations=3, turns=3, think_time_s=0.05, resolution_scale=0.05, output_len_mean=3,
                       output_len_std=0, output_len_min=3, output_len_max=3)


class ChatBackend:
    """Answers "answer to <request id>" token by token; remembers each request's prompt and send/end times."""

    def __init__(self, gap=0.002, fail_ids=(), cached=False):
        self.gap, self.fail_ids, self.cached = gap, set(fail_ids), cached
        self.lock = threading.Lock()
        self.sent, self.done, self.prompts = {}, {}, {}

    def stream(self, req):
        with self.lock:
            self.sent[req.request_id], self.prompts[req.request_id] = time.monotonic(), req.prompt
        if req.request_id in self.fail_ids:
            raise RuntimeError("instance died")
        for word in ["answer", "to", req.request_id][: req.max_tokens]:
            time.sleep(self.gap)
            yield SimpleNamespace(token_ids=[7], text=word + " ")
        usage = {"prompt_tokens": len(req.prompt) // 4, "output_tokens": req.max_tokens}
        if self.cached:
            usage["cached_tokens"] = 16 * (req.turn - 1)
        with self.lock:
            self.done[req.request_id] = time.monotonic()
        yield SimpleNamespace(token_ids=[], finished=True, finish_reason="length", usage=usage)


def test_each_turn_goes_after_the_previous_answer_and_the_think_time():
    convs = build_conversations(TINY)
    be = ChatBackend()
    recs = run_conversations(be, convs, RunConfig(rate=50, seed=0, progress=False))
    assert [r.request_id for r in recs] == [f"{c.conversation_id}-t{t}" for c in convs for t in (1, 2, 3)]
    assert all(r.success for r in recs) and [r.turn for r in recs[:3]] == [1, 2, 3]
    for c in convs:
        for t in (2, 3):
            prev, this = f"{c.conversation_id}-t{t - 1}", f"{c.conversation_id}-t{t}"
            assert be.sent[this] >= be.done[prev] + TINY.think_time_s * 0.9  # closed loop, after the think time
            assert f"answer to {prev}<|im_end|>" in be.prompts[this]  # the history carries the actual answer
    # conversations overlap: the second starts before the first has finished
    assert be.sent[f"{convs[1].conversation_id}-t1"] < be.done[f"{convs[0].conversation_id}-t3"]


def test_a_failed_turn_ends_its_conversation():
    convs = build_conversations(TINY)
    first = convs[0].conversation_id
    be = ChatBackend(fail_ids={f"{first}-t2"})
    recs = run_conversations(be, convs, RunConfig(rate=50, progress=False))
    mine = [r for r in recs if r.request_id.startswith(first + "-")]
    assert [(r.turn, r.success) for r in mine] == [(1, True), (2, False), (3, False)]
    assert "not sent" in mine[2].error and f"{first}-t3" not in be.sent
    assert sum(r.success for r in recs) == 7


def _args(argv):
    p = argparse.ArgumentParser()
    add_parser(p.add_subparsers())
    return p.parse_args(["serve", "--no-progress", "--warmup", "1", *argv])


@pytest.mark.parametrize("cached", [False, True])
def test_bench_serve_multiturn_reports_ttft_per_turn(cached):
    args = _args(["--workload", "multiturn", "--conversations", "3", "--turns", "3", "--think-time-s", "0.02",
                  "--resolution-scale", "0.05", "--output-len", "3", "--output-len-range", "3-3"])
    (cfg,) = workload_configs(args)
    assert isinstance(cfg, MultiturnConfig) and (cfg.conversations, cfg.turns, cfg.think_time_s) == (3, 3, 0.02)
    slo = SLO(ttft_ms=1000, tpot_ms=500)
    report = {"slo": slo.to_dict(), "workloads": {}}
    for label in ("monolithic", "monolithic#no-cache"):
        run_target(ChatBackend(cached=cached), label, [cfg], "20,20", args, slo, report, lambda: None)
    modes = report["workloads"]["multiturn"]["modes"]
    runs = modes["monolithic"]["runs"]
    assert len(runs) == 2 and runs[0]["seed"] != runs[1]["seed"]  # each repeat: conversations of its own
    assert runs[1]["seed"] == modes["monolithic#no-cache"]["runs"][1]["seed"]  # the same for every target
    run = runs[0]
    assert run["metrics"]["completed"] == 9 and [p["turn"] for p in run["turns"]["per_turn"]] == [1, 2, 3]
    assert {r["turn"] for r in run["requests"]} == {1, 2, 3}
    md = markdown(report, baseline="monolithic")
    assert "TTFT p50 per turn" in md and "| turn 1 | turn 2 | turn 3 | turn 1 | turns >= 2 |" in md
    assert ("Cached prompt tokens per request" in md) == cached
    if cached:
        assert run["turns"]["per_turn"][1]["cached_tokens_mean"] == 16 and run["requests"][1]["cached_tokens"] == 16


def _run(ttft1, ttft2, goodput, share=None):
    later = {"ttft_ms": {"p50": ttft2}, **({"cached_share": share} if share is not None else {})}
    return {"rate": 0.25, "metrics": {"goodput": goodput, "tpot_ms": {"p50": 20.0}},
            "turns": {"first": {"ttft_ms": {"p50": ttft1}}, "later": later}}


def test_pair_ratios_per_repeat_and_aims():
    modes = {"monolithic": [_run(900, 200, 1.0), _run(900, 250, 1.0)],
             "monolithic#no-cache": [_run(900, 1000, 0.8), _run(900, 900, 0.9)],
             "P-D": [_run(900, 300, 1.0, share=0.8)], "P-D#no-cache": [_run(900, 600, 1.0)],
             "P-D#2P": [_run(900, 300, 1.4, share=0.76)], "P-D#2P-least-load": [_run(900, 600, 1.0, share=0.3)]}
    report = {"workloads": {"multiturn": {"modes": {k: {"runs": v} for k, v in modes.items()}}}}
    rows = {r["pair"]: r for r in pair_rows(report)}
    mono = rows["monolithic"]
    assert mono["ttft_later"]["ratio"] == pytest.approx(225 / 950) and mono["ttft_met"] is True
    assert mono["ttft_later"]["per_repeat"] == pytest.approx([0.2, 250 / 900]) and mono["repeats"] == 2
    assert rows["P-D"]["ttft_met"] is False and rows["P-D"]["goodput_met"] is None  # 0.5x > 0.3: not met
    routing = rows["2 P routing"]
    assert routing["goodput"]["ratio"] == pytest.approx(1.4) and routing["goodput_met"] is True
    assert routing["hit_vs_ideal"]["ratio"] == pytest.approx(0.95) and routing["hit_met"] is True
    table = pair_table(list(rows.values()))
    assert "| monolithic | monolithic / monolithic#no-cache | 2 | 0.24x (0.20-0.28) | <= 0.3: met |" in table
    assert "0.95x vs P-D (>= 0.9: met)" in table
    tt = target_table(report, list(modes))
    assert "| monolithic | 2 | 900 (900-900) | 225 (200-250) | 20.0 (20.0-20.0) | 1.000 (1.000-1.000) | - |" in tt


def test_benchmark_targets_pairs_back_to_back_with_their_launch_args():
    a = parser().parse_args(["--quick"])
    modes, mode_args = targets(a, PAIRS)
    assert modes == ["monolithic", "monolithic#no-cache", "P-D", "P-D#no-cache", "P-D#2P", "P-D#2P-least-load"]
    assert "monolithic#no-cache=--no-prefix-caching" in mode_args and "P-D#2P=--prefill 2" in mode_args
    assert "P-D#2P-least-load=--prefill 2 --scheduler-args='--routing least-load'" in mode_args
    argv = bench_argv(a, QUICK, "MODEL", __import__("pathlib").Path("o.json"), PAIRS)
    assert argv[:2] == ["bench", "serve"] and argv[argv.index("--workload") + 1] == "multiturn"
    assert argv[argv.index("--request-rate") + 1] == "1" and argv[argv.index("--turns") + 1] == "2"
    args = _args(argv[2:])  # bench serve accepts what the benchmark passes
    assert args.modes.split(",") == modes
    ll = next(m for m in args.mode_arg if m.startswith("P-D#2P-least-load="))
    assert shlex.split(ll.partition("=")[2]) == ["--prefill", "2", "--scheduler-args=--routing least-load"]


def test_openai_body_sends_the_history_as_messages():
    conv = build_conversations(TINY)[0]
    body = chat_body(conv.request(1, ["it is red"]))
    roles = [m["role"] for m in body["messages"]]
    assert roles == ["user", "assistant", "user"]
    first = body["messages"][0]["content"]
    assert [p["type"] for p in first] == ["image_url"] * len(conv.images) + ["text"]
    assert first[-1]["text"] == conv.questions[0] and body["messages"][1]["content"] == "it is red"
    assert body["messages"][2]["content"] == conv.questions[1]
