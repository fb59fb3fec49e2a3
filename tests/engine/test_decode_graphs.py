"""Decode steps replayed from graphs (engine/graph_runner.py) stay exact: batches padded to their
bucket, tables to their width, padding rows confined to the KV cache's padding block. Run on the
CPU with graphs that replay by rerunning the captured body (tests/fakes/replay_graphs.py); on CUDA
the same runner captures real CUDA graphs (checked by `epdserve bench device`)."""
import pytest

from epdserve import LLM, SamplingParams
from epdserve.engine.graph_runner import DecodeGraphs, batch_buckets
from epdserve.model.reference import ReferenceGenerator
from tests.engine.blocks import all_blocks_free
from tests.fakes.replay_graphs import FailingGraphsPlatform, ReplayGraphsPlatform


@pytest.fixture(scope="module")
def setup(qwen2_vl_tiny):
    llm = LLM(model=qwen2_vl_tiny, device="cpu", max_num_seqs=8)
    r = llm.engine.runner
    assert r.graphs is None  # the CPU runs eagerly
    platform = ReplayGraphsPlatform()
    r.graphs = DecodeGraphs(r.lm, r.kv_cache, r.ops, r.layer_ops, platform, r.buffers, max_batch=8,
                            max_blocks=64)
    return llm, ReferenceGenerator(qwen2_vl_tiny), platform


def test_buckets():
    assert batch_buckets(128)[:6] == [1, 2, 4, 8, 16, 24] and batch_buckets(128)[-1] == 128
    assert batch_buckets(3) == [1, 2, 3]


@pytest.mark.parametrize("n", [1, 3, 5])
def test_padded_batches_equal_transformers(setup, n):
    llm, ref, platform = setup
    # lengths spread so the tables span width buckets 8 and 16 (16-token blocks)
    prompts = [" ".join(["word"] * (4 + 40 * i)) + f" number {i}" for i in range(n)]
    outs = llm.generate(prompts, SamplingParams(max_tokens=8, ignore_eos=True))
    for p, o in zip(prompts, outs):
        assert o.error is None
        assert o.outputs[0].token_ids == ref.generate(p, [], 8), p
    graphs = llm.engine.runner.graphs.graphs
    assert any(k[0] >= n for k in graphs), graphs.keys()
    assert sum(g.replays for g in platform.captured) > 0
    assert all_blocks_free(llm.engine)


def test_capture_startup_covers_every_bucket(setup):
    llm, _, _ = setup
    r = llm.engine.runner
    r.graphs.capture_startup(7)  # blocks: the narrowest width bucket
    assert {(b, 8) for b in r.graphs.buckets} <= set(r.graphs.graphs)
    r.graphs.reset()
    r.graphs.capture_startup(16)  # the engine's start-up context (256 tokens): widths 8 and 16, every batch
    assert {(b, w) for b in r.graphs.buckets for w in (8, 16)} <= set(r.graphs.graphs)


def test_every_graph_writes_its_logits_into_one_shared_buffer(setup):
    """Issue 52 item 1: one fp32 logits buffer of the largest bucket for all graphs; each graph's
    output is its first rows (no [batch, vocab] buffer per graph)."""
    llm, _, _ = setup
    g = llm.engine.runner.graphs
    g.capture_startup(16)
    shared = g.logits
    assert shared is not None and shared.shape[0] == g.buckets[-1] and shared.dtype.is_floating_point
    for (bp, _), (_, out, _) in g.graphs.items():
        assert out.data_ptr() == shared.data_ptr() and out.shape == (bp, shared.shape[1])


def test_a_capture_that_fails_falls_back_to_eager(qwen2_vl_tiny):
    llm = LLM(model=qwen2_vl_tiny, device="cpu", max_num_seqs=4)
    r = llm.engine.runner
    r.graphs = DecodeGraphs(r.lm, r.kv_cache, r.ops, r.layer_ops, FailingGraphsPlatform(), r.buffers, max_batch=4,
                            max_blocks=64)
    assert r.capture_graphs() == 0.0 and r.graphs is None  # at start-up: eager, said once
    r.graphs = DecodeGraphs(r.lm, r.kv_cache, r.ops, r.layer_ops, FailingGraphsPlatform(), r.buffers, max_batch=4,
                            max_blocks=64)
    want = ReferenceGenerator(qwen2_vl_tiny).generate("a prompt of a few words", [], 6)
    out = llm.generate(["a prompt of a few words"], SamplingParams(max_tokens=6, ignore_eos=True))[0]
    assert out.outputs[0].token_ids == want and r.graphs is None  # mid-serving: that step and the rest eager
    report = r.graph_report()  # the evidence says so, with the capture's own error
    assert not report["graphs"] and report["keys"] == 0
    assert report["why_off"] == "capture failed: RuntimeError: operation not permitted when stream is capturing"
    assert report["eager_decode_steps"] == {report["why_off"]: 6 - 1}  # every decode step after the prefill's


def test_the_graph_evidence_counts_replays_and_eager_steps_by_reason(setup, qwen2_vl_tiny):
    """Issue 52 item 3: keys captured, replays and eager decode steps, on the stand-in and on the
    CPU as it is (no graphs: every decode step eager, and why)."""
    llm, _, _ = setup
    r = llm.engine.runner
    before = r.graph_report()
    llm.generate(["count my decode steps please"], SamplingParams(max_tokens=5, ignore_eos=True))
    after = r.graph_report()
    assert after["graphs"] and after["why_off"] == "" and after["keys"] == len(r.graphs.graphs) > 0
    assert after["replays"] - before["replays"] == 4 and after["eager_decode_steps"] == before["eager_decode_steps"]
    cpu = LLM(model=qwen2_vl_tiny, device="cpu", max_num_seqs=4, kv_cache_bytes=4 << 20)
    cpu.generate(["count my decode steps please"], SamplingParams(max_tokens=5, ignore_eos=True))
    report = cpu.engine.runner.graph_report()
    assert not report["graphs"] and report["replays"] == 0
    assert report["eager_decode_steps"] == {"the platform has no graphs (cpu decodes eagerly)": 4}


def test_the_start_up_self_check_keeps_graphs_that_replay_what_eager_computes(qwen2_vl_tiny):
    """Issue 53 item 1: after the start-up captures one step is replayed against eager
    (engine/graph_check.py); on graphs that replay rightly, graphs stay on."""
    llm = LLM(model=qwen2_vl_tiny, device="cpu", max_num_seqs=4, kv_cache_bytes=4 << 20)
    r = llm.engine.runner
    r.graphs = DecodeGraphs(r.lm, r.kv_cache, r.ops, r.layer_ops, ReplayGraphsPlatform(), r.buffers, max_batch=4,
                            max_blocks=64)
    assert r.capture_graphs() > 0 and r.graphs is not None and r.graph_report()["why_off"] == ""


def test_every_bucket_runs_eagerly_before_its_capture(qwen2_vl_tiny):
    """Issue 52 item 1: each bucket's shapes run once eagerly right before that bucket's capture
    (a Triton JIT compile or a library's first call inside a CUDA capture would break it)."""
    events = []

    class Recording(ReplayGraphsPlatform):
        def graph_pool(self):
            return object()  # a pool handle, as CUDA's graph_pool_handle() gives

        def capture_graph(self, fn, pool):
            events.append("capture")
            return super().capture_graph(fn, pool)

    llm = LLM(model=qwen2_vl_tiny, device="cpu", max_num_seqs=4, kv_cache_bytes=4 << 20)
    r = llm.engine.runner
    g = DecodeGraphs(r.lm, r.kv_cache, r.ops, r.layer_ops, Recording(), r.buffers, max_batch=4, max_blocks=64)
    body = g._body
    g._body = lambda bp, w, tasks=None: (events.append(("body", bp, w)), body(bp, w, tasks))[1]
    g.capture_startup(7)
    captures = [i for i, e in enumerate(events) if e == "capture"]
    assert len(captures) == len(g.buckets) == 3
    for i in captures:  # the eager run of the bucket, its capture, the captured body's run (this stand-in reruns it)
        assert events[i - 1] == events[i + 1] and events[i - 1][0] == "body", events


def test_an_engine_that_never_decodes_has_no_graphs(setup):
    """Issue 52 item 1: E and P engines capture nothing and hold no logits buffers."""
    from epdserve.engine.model_runner import ModelRunner

    llm, _, _ = setup
    r = llm.engine.runner
    parts = (r.adapter, r.lm, r.kv_cache, r.ops, r.layer_ops, ReplayGraphsPlatform())
    prefill_only = ModelRunner(*parts, max_batch=4, decodes=False)
    assert prefill_only.graphs is None and prefill_only.capture_graphs() == 0.0
    assert prefill_only.graph_report()["why_off"] == "this engine never decodes (E or P): no graphs, no logits buffers"
    assert isinstance(ModelRunner(*parts, max_batch=4).graphs, DecodeGraphs)  # a decoding one on the same platform
