"""NPU decode graphs (issue 53 items 1 and 5) on the torch_npu stand-in, whose NPUGraph replays the
tasks it captured with their captured host arguments unless a graph-task update re-issued them
(tests/fakes/npu_graphs_fake.py): graphs on give the tokens eager gives at batch 1, 3 and 32 while
contexts grow (one in eight across a block boundary mid-run); an update that does not re-issue the lengths gives
wrong tokens, and a skipped one never finishes its replay; the start-up self-check turns graphs off
with the reason; a torch_npu without the API is refused with its reason."""
from __future__ import annotations

import dataclasses

import pytest
import torch
import transformers.models.qwen2_vl.modeling_qwen2_vl  # noqa: F401  before the fake torch_npu is installed
from transformers import AutoModelForImageTextToText

from epdserve.engine.kv_cache import KVCacheSpec, PagedKVCache
from epdserve.engine.lm.forward import LeanLM
from epdserve.engine.model_runner import ModelRunner
from epdserve.engine.sampling_params import SamplingParams
from epdserve.engine.sequence import Sequence
from epdserve.engine.step_contract import ScheduledStep
from epdserve.model.adapter import VLMAdapter
from epdserve.model.demo import PRESETS, demo_config
from epdserve.ops.npu_graph_fia import FiaGraphTasks
from epdserve.ops.npu_layer_ops import NpuLayerOps
from epdserve.ops.npu_ops import NpuPagedOps
from epdserve.platform.npu import NpuPlatform
from epdserve.platform.npu_graphs import GRAPH_API
from tests.fakes.npu_graphs_fake import GraphReplayHang
from tests.fakes.npu_kernels_fake import LINES, NEWEST, line_npu_exports
from tests.fakes.torch_npu_fake import FakeTorchNpu
from tests.ops.test_npu_ops_contract import _fia

BLOCK, LAYERS, STEPS = 128, 2, 4
FIA = "npu_fused_infer_attention_score"
_IDS = {"<|endoftext|>": 1990, "<|im_end|>": 1991, "<|image_pad|>": 1992, "<|video_pad|>": 1993,
        "<|vision_start|>": 1994, "<|vision_end|>": 1995}


@pytest.fixture(scope="module")
def model():
    size = dataclasses.replace(PRESETS["tiny"], layers=LAYERS, hidden=256, mrope_section=(8, 12, 12))  # head_dim 64
    torch.manual_seed(0)
    hf = AutoModelForImageTextToText.from_config(demo_config("qwen2_vl", size, _IDS, vocab=2000),
                                                 dtype=torch.bfloat16).eval()
    a = VLMAdapter(hf)
    return a, LeanLM(a, 1024)


@pytest.fixture(scope="module")
def fake():
    with pytest.MonkeyPatch.context() as mp:
        yield FakeTorchNpu(line=NEWEST, kernels={FIA: _fia}).install(mp)


def _runner(model, enforce_eager=False, max_batch=32, capture=True) -> ModelRunner:
    a, lm = model
    kv = PagedKVCache(KVCacheSpec(LAYERS, a.num_kv_heads, a.head_dim, BLOCK, torch.bfloat16), num_blocks=70)
    r = ModelRunner(a, lm, kv, NpuPagedOps(), NpuLayerOps(), NpuPlatform(), max_batch=max_batch,
                    max_model_len=1024, enforce_eager=enforce_eager)
    if capture:
        r.capture_graphs()
    return r


@pytest.fixture(scope="module")
def runners(fake, model):
    return _runner(model), _runner(model, enforce_eager=True)


def _prompt_len(i: int) -> int:
    """Every 8th prompt (the first included) 125..126 tokens: it crosses into its second block
    while decoding; the others short (cheap to prefill on the stand-in)."""
    return 125 + i % 2 if i % 8 == 0 else 6 + i


def _generate(runner, n: int) -> list[list[int]]:
    """n prompts prefilled in one step, then STEPS decode steps of all of them; the tokens each drew."""
    seqs = [Sequence(f"r{i}", [(7 * i + 3 * j) % 1900 for j in range(_prompt_len(i))], SamplingParams(max_tokens=STEPS))
            for i in range(n)]
    blocks = [(2 * i, 2 * i + 1) for i in range(n)]
    for s in seqs:
        s.positions = torch.arange(s.prompt_len).expand(3, s.prompt_len)

    def table(i, ctx):
        return blocks[i][: -(-ctx // BLOCK)]  # grows as the context does

    spans = [(s, 0, s.prompt_len, table(i, s.prompt_len)) for i, s in enumerate(seqs)]
    for _ in range(STEPS + 1):
        tokens = runner.execute(ScheduledStep.of(spans)).tokens
        for s, t in zip(seqs, tokens):
            s.output_token_ids.append(t)
            s.num_computed_tokens = s.num_tokens - 1
        spans = [(s, s.num_computed_tokens, 1, table(i, s.num_tokens)) for i, s in enumerate(seqs)]
    return [s.output_token_ids for s in seqs]


@pytest.mark.parametrize("n", [1, 3, 32])
def test_graphs_give_the_eager_tokens_while_contexts_grow(runners, fake, n):
    graphs, eager = runners
    assert graphs.graphs is not None and eager.graphs is None  # --enforce-eager still decodes eagerly
    before = graphs.graph_report()
    fake.kernel_calls.clear()
    assert _generate(graphs, n) == _generate(eager, n)
    after = graphs.graph_report()
    assert after["replays"] - before["replays"] == STEPS and after["eager_decode_steps"] == {}
    # the last replay's update re-issued each layer's attention with that step's lengths, padding rows at 1
    updates = [c[2] for c in fake.kernel_calls if c[0] == f"{FIA}.out"]
    bucket = next(b for b in graphs.graphs.buckets if b >= n)
    last = [_prompt_len(i) + STEPS for i in range(n)] + [1] * (bucket - n)
    assert last[0] > BLOCK > last[0] - STEPS  # the first row's table grew mid-run
    assert [u["actual_seq_lengths_kv"] for u in updates[-LAYERS:]] == [last] * LAYERS
    assert all(u["workspace"] is not None for u in updates)


def test_graph_evidence_on_the_npu(runners):
    report = runners[0].graph_report()
    assert report["graphs"] and report["why_off"] == "" and report["keys"] == 7  # buckets 1..32 at width 8
    assert runners[1].graph_report()["why_off"] == "--enforce-eager (or tensor parallelism)"
    for _, _, tasks in runners[0].graphs.graphs.values():  # one task group per layer, one workspace per graph
        assert len(tasks.sites) == LAYERS and {id(s.kwargs["workspace"]) for s in tasks.sites} == {id(tasks.workspace)}


def test_a_capture_whose_body_fails_raises_its_own_error_and_restores_the_stream(fake):
    plat, before = NpuPlatform(), fake.current_stream()

    def body():  # a host read while capturing: the capture is invalidated, capture_end raises too
        return torch.ones(1).item()

    with pytest.raises(RuntimeError, match="operation not permitted when stream is capturing"):
        plat.capture_graph(body, plat.graph_pool())
    assert fake.current_stream() == before and not fake.graphs.capturing


def _record_only(self, q_ends, kv_lens):
    """An update pass that releases each replay without re-issuing the lengths (stale lengths)."""
    for site in self.sites:
        site.event.record(self._stream)


def test_an_update_that_does_not_reissue_the_lengths_gives_wrong_tokens(runners, fake, model, monkeypatch):
    want = _generate(runners[1], 3)
    r = _runner(model, max_batch=4, capture=False)  # captured now, below: its tasks hold the capture's lengths
    monkeypatch.setattr(FiaGraphTasks, "update", _record_only)
    assert _generate(r, 3) != want  # every replay attended the capture's lengths (1 token each)
    assert r.graph_report()["replays"] == STEPS


def test_a_skipped_update_never_finishes_its_replay(fake, model, monkeypatch):
    r = _runner(model, max_batch=4)
    monkeypatch.setattr(FiaGraphTasks, "update", lambda self, q_ends, kv_lens: None)
    _generate(r, 2)
    report = r.graph_report()  # the stand-in's hang surfaced as the replay's error: graphs off, eager from then
    assert not report["graphs"] and report["why_off"].startswith(f"capture failed: {GraphReplayHang.__name__}")


def test_the_self_check_falls_back_to_eager_with_the_reason(runners, model, monkeypatch):
    monkeypatch.setattr(FiaGraphTasks, "update", _record_only)
    r = _runner(model, max_batch=4)
    report = r.graph_report()
    assert not report["graphs"] and report["why_off"].startswith("self-check: a replayed decode step differs from eager")
    assert _generate(r, 2) == _generate(runners[1], 2)
    assert r.graph_report()["eager_decode_steps"] == {report["why_off"]: STEPS}


@pytest.mark.parametrize("line", LINES)
def test_every_line_the_extras_install_has_what_the_graphs_call(line, monkeypatch):
    """The torch_npu.npu names and the FIA .out / max-workspace schemas, as each wheel has them
    (tests/fixtures/torch_npu/<line>.txt, scripts/npu_signatures.py)."""
    assert set(GRAPH_API) <= line_npu_exports(line)
    FakeTorchNpu(line=line, kernels={FIA: _fia}).install(monkeypatch)
    assert NpuPlatform().graphs_unavailable_reason() is None and NpuPlatform().has_graphs
    assert NpuPagedOps().graphs_unavailable_reason() is None


def test_a_torch_npu_without_the_graph_api_decodes_eagerly_and_says_why(model, monkeypatch):
    FakeTorchNpu(line=NEWEST, kernels={FIA: _fia}, graph_api=False).install(monkeypatch)
    r = _runner(model, max_batch=4, capture=False)
    assert r.graphs is None
    assert r.graph_report()["why_off"] == (f"torch_npu {NEWEST}+fake has no torch.npu.NPUGraph, graph, graph_pool_handle, "
                                           "ExternalEvent, graph_task_group_begin, graph_task_group_end, "
                                           "graph_task_update_begin, graph_task_update_end (NPU graphs with task updates)")


def test_a_line_without_the_fia_out_schema_decodes_eagerly_and_says_why(model, monkeypatch):
    fake = FakeTorchNpu(line=NEWEST, kernels={FIA: _fia}).install(monkeypatch)
    packet = fake.ops["npu"]._ops[FIA]
    monkeypatch.delattr(packet, "out")
    r = _runner(model, max_batch=4, capture=False)
    assert r.graph_report()["why_off"] == f"torch_npu {NEWEST}+fake registers no npu::{FIA}.out"
