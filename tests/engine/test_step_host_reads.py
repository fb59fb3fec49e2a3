"""A step reads the device back once — the sampled tokens — however many layers the model has
(issue 26 item 5), on the NPU path (NpuPagedOps over the torch_npu stand-in, kernels counted
as device work) and on the portable one; and a prefill step makes one attention call per layer.
Host reads are counted by tests/fakes/host_reads.py."""
from __future__ import annotations

import dataclasses
import sys

import pytest
import torch
import transformers.models.qwen2_vl.modeling_qwen2_vl  # noqa: F401  before the fake torch_npu is installed:
from transformers import AutoModelForImageTextToText  # transformers' import probes find_spec("torch_npu")

from epdserve.engine.kv_cache import KVCacheSpec, PagedKVCache
from epdserve.engine.lm.forward import LeanLM
from epdserve.engine.model_runner import ModelRunner
from epdserve.engine.sampling_params import SamplingParams
from epdserve.engine.sequence import Sequence
from epdserve.engine.step_contract import ScheduledStep
from epdserve.model.adapter import VLMAdapter
from epdserve.model.demo import PRESETS, demo_config
from epdserve.ops.npu_ops import NpuPagedOps
from epdserve.ops.layer_ops import PortableLayerOps
from epdserve.ops.npu_layer_ops import NpuLayerOps
from epdserve.ops.portable import PortableOps
from epdserve.platform import get_platform
from tests.fakes.host_reads import HostReads
from tests.fakes.npu_kernels_fake import NEWEST
from tests.fakes.torch_npu_fake import FakeTorchNpu
from tests.ops.test_npu_ops_contract import _fia

BLOCK = 128  # the NPU block size: prompt chunks need a multiple of 128
_IDS = {"<|endoftext|>": 1990, "<|im_end|>": 1991, "<|image_pad|>": 1992, "<|video_pad|>": 1993,
        "<|vision_start|>": 1994, "<|vision_end|>": 1995}
FIA = "npu_fused_infer_attention_score"


def _runner(layers: int, ops) -> ModelRunner:
    # head_dim 64: a head_dim FIA's TND layout takes (prompt_flash_attention_tiling.cpp)
    size = dataclasses.replace(PRESETS["tiny"], layers=layers, hidden=256, mrope_section=(8, 12, 12))
    torch.manual_seed(0)
    model = AutoModelForImageTextToText.from_config(demo_config("qwen2_vl", size, _IDS, vocab=2000),
                                                    dtype=torch.bfloat16).eval()
    a = VLMAdapter(model)
    lm = LeanLM(a, 4096)
    kv = PagedKVCache(KVCacheSpec(layers, a.num_kv_heads, a.head_dim, BLOCK, torch.bfloat16), num_blocks=6)
    layer_ops = NpuLayerOps() if isinstance(ops, NpuPagedOps) else PortableLayerOps()  # the NPU's own kernels
    return ModelRunner(a, lm, kv, ops, layer_ops, get_platform("cpu"))


def _seq(i: int, n: int) -> Sequence:
    s = Sequence(f"r{i}", [(7 * i + 3 * j) % 1900 for j in range(n)], SamplingParams(max_tokens=4))
    s.positions = torch.arange(n).expand(3, n)
    return s


def _step(runner, spans, reads: HostReads | None = None):
    """Run one step of (request, start, tokens, block table) spans; its sampled tokens."""
    if reads is None:
        return runner.execute(ScheduledStep.of(spans)).tokens
    with reads:
        return runner.execute(ScheduledStep.of(spans)).tokens


def _counted(runner, npu_calls, items) -> tuple[list, list]:
    reads = HostReads()
    reads.mark(*runner.adapter.hf.parameters(), *runner.adapter.hf.buffers(), *runner.lm.tensors(), *runner.kv_cache.keys,
               *runner.kv_cache.values)
    mod = sys.modules.get("torch_npu")
    if mod is not None:  # the stand-in's kernels run as device work
        for name in (FIA, "npu_scatter_pa_kv_cache", "_npu_reshape_and_cache"):
            if hasattr(mod, name):
                setattr(mod, name, reads.kernel(getattr(mod, name)))
    npu_calls.clear()
    _step(runner, items, reads)
    return reads.reads, [c[0] for c in npu_calls if c[0] == FIA]


@pytest.fixture
def npu_calls(monkeypatch) -> list:
    """The newest line's operators (each line's own are tests/ops' business); the calls made."""
    return FakeTorchNpu(line=NEWEST, kernels={FIA: _fia}).install(monkeypatch).kernel_calls


@pytest.fixture(params=["npu", "portable"])
def ops_name(request):
    return request.param, request.getfixturevalue("npu_calls") if request.param == "npu" else []


def _prefill_then_decode(runner, npu_calls):
    """Two prompts prefilled, then (counted) one decode step of both."""
    seqs = [_seq(1, 5), _seq(2, 9)]
    out = _step(runner, [(s, 0, s.prompt_len, (k,)) for k, s in enumerate(seqs)])
    for s, t in zip(seqs, out):
        s.output_token_ids.append(t)
        s.num_computed_tokens = s.prompt_len
    return _counted(runner, npu_calls, [(s, s.prompt_len, 1, (k,)) for k, s in enumerate(seqs)])


def test_a_decode_step_reads_the_device_once_whatever_the_layer_count(ops_name):
    name, calls = ops_name
    ops = NpuPagedOps() if name == "npu" else PortableOps()
    counts = {}
    for layers in (2, 4):
        reads, fia = _prefill_then_decode(_runner(layers, ops), calls)
        assert len(reads) == 1, reads  # the sampled tokens: sample()'s argmax(...).tolist()
        assert reads[0][0] == "tolist" and "sampler.py" in reads[0][1], reads
        counts[layers] = len(reads)
        if name == "npu":
            assert len(fia) == layers  # one attention call per layer for the whole batch
    assert counts[2] == counts[4]


def test_a_mixed_step_is_one_attention_call_per_layer_and_one_read(npu_calls):
    """A later prompt chunk, a fresh prompt and a decode in one step, on the NPU path."""
    calls = npu_calls
    runner = _runner(3, NpuPagedOps())
    long, dec = _seq(3, 200), _seq(4, 6)
    _step(runner, [(long, 0, 130, (0, 1)), (dec, 0, 6, (2,))])
    dec.output_token_ids.append(5)
    dec.num_computed_tokens = 6
    fresh = _seq(5, 140)
    reads, fia = _counted(runner, calls, [(long, 130, 70, (0, 1)), (fresh, 0, 140, (3, 4)),
                                          (dec, 6, 1, (2,))])
    assert len(fia) == 3
    assert [r[0] for r in reads] == ["tolist"], reads
    call = [c for c in calls if c[0] == FIA][0][2]
    assert call["actual_seq_lengths"] == [70, 210, 211] and call["actual_seq_lengths_kv"] == [200, 140, 7]
    assert call["block_table"] == (torch.int32, (3, 2), True)


def test_the_counter_sees_a_per_layer_read_of_device_lengths():
    """The harness's negative control: the old decode path, `ctx_lens.tolist()` on uploaded lengths."""
    reads = HostReads()
    with reads:
        ctx = torch.tensor([5, 9], device="cpu")  # an upload: device-resident
        for _ in range(4):
            ctx.tolist()
        host = torch.tensor([5, 9])
        host.tolist()  # a host tensor: not a read
    assert [r[0] for r in reads.reads] == ["tolist"] * 4
