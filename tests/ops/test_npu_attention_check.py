"""The start-up check of the NPU attention (ops/npu_attention_check.py) on the fake torch_npu:
what PFA's TND tiling refuses (prompt_flash_attention_tiling.cpp CheckInputShapeWhenLayoutIsTND:
bf16 only; head_dim 64 / 128 / 192, 192 without GQA) is refused from the KV spec without a kernel
call; a CANN whose FIA refuses TND with a paged KV (the 8.3 line: vllm-ascend issues #4373 /
#8045 on 8.3.RC1) or answers wrongly stops the engine with the CANN and the extras that work."""
from __future__ import annotations

import pytest
import torch

from epdserve.engine.kv_cache import KVCacheSpec
from epdserve.ops.npu_ops import NpuPagedOps
from epdserve.ops.npu_schema import NpuKernelsUnsupported
from tests.fakes.npu_kernels_fake import LINES, line_cann
from tests.fakes.torch_npu_fake import FakeTorchNpu
from tests.ops.test_npu_ops_contract import _fia

FIA = "npu_fused_infer_attention_score"
CPU = torch.device("cpu")  # the stand-in's device


def _spec(dtype=torch.bfloat16, head_dim=128, kv_heads=2):
    return KVCacheSpec(num_layers=2, num_kv_heads=kv_heads, head_dim=head_dim, block_size=128, dtype=dtype)


@pytest.mark.parametrize("line", LINES)
def test_each_lines_own_cann_decides(monkeypatch, line):
    fake = FakeTorchNpu(line=line, kernels={FIA: _fia}).install(monkeypatch)
    ops = NpuPagedOps()
    if line_cann(line) == "8.3.RC1":  # torch_npu 2.8.0, the npu-cann83 line, on the CANN it is built for
        with pytest.raises(NpuKernelsUnsupported, match=r"CANN \(8\.3\.RC1\) refuses .*561002.*\[npu\] extra"):
            ops.check_kv_spec(_spec(), 4, CPU)
    else:
        ops.check_kv_spec(_spec(), 4, CPU)
    write, call = fake.kernel_calls  # the KV write the engine uses, then one attention call (issue 53 item 3):
    assert write[0] != FIA  # a decode row, a 2-token chunk, and a decode row over two blocks (128 + 3 keys)
    assert call[0] == FIA and call[2]["input_layout"] == "TND" and call[2]["actual_seq_lengths"] == [1, 3, 4]
    assert call[2]["actual_seq_lengths_kv"] == [5, 3, 131] and call[2]["sparse_mode"] == 3


def test_cann_8_3_rc2_takes_it_as_vllm_ascend_0_13_runs_it(monkeypatch):
    """vllm-ascend v0.13.0 (CANN 8.3.rc2, torch-npu 2.8.0) makes this call for every step."""
    FakeTorchNpu(line="2.8.0", kernels={FIA: _fia}, cann="8.3.RC2").install(monkeypatch)
    NpuPagedOps().check_kv_spec(_spec(), 4, CPU)


@pytest.mark.parametrize("head_dim", [64, 128, 192])
def test_the_head_dims_tnd_takes_pass(monkeypatch, head_dim):
    FakeTorchNpu(kernels={FIA: _fia}).install(monkeypatch)
    kv_heads = 4 if head_dim == 192 else 2  # 192 only without GQA
    NpuPagedOps().check_kv_spec(_spec(head_dim=head_dim, kv_heads=kv_heads), 4, CPU)


@pytest.mark.parametrize("dtype,head_dim,kv_heads,match", [
    (torch.float16, 128, 2, "bfloat16 only, not torch.float16.*--dtype bfloat16"),
    (torch.float32, 128, 2, "bfloat16 only"),
    (torch.bfloat16, 80, 2, "head_dim 64, 128 or 192.*has 80"),
    (torch.bfloat16, 192, 2, "head_dim 192 with grouped-query attention"),
])
def test_what_the_tiling_refuses_is_refused_without_a_kernel_call(monkeypatch, dtype, head_dim, kv_heads, match):
    fake = FakeTorchNpu(kernels={FIA: _fia}).install(monkeypatch)
    with pytest.raises(NpuKernelsUnsupported, match=match):
        NpuPagedOps().check_kv_spec(_spec(dtype, head_dim, kv_heads), 4, CPU)
    assert fake.kernel_calls == []


def test_the_fake_kernel_refuses_fp16_in_tnd_as_the_tiling_does(monkeypatch):
    """The stand-in follows prompt_flash_attention_tiling.cpp: fp16 in TND is an error."""
    FakeTorchNpu(kernels={FIA: _fia}).install(monkeypatch)
    import torch_npu

    q = torch.zeros(1, 4, 64, dtype=torch.float16)
    kv = torch.zeros(1, 128, 2 * 64, dtype=torch.float16)
    with pytest.raises(RuntimeError, match="inputDataType should be bf16"):
        torch_npu.npu_fused_infer_attention_score(q, kv, kv, block_table=torch.zeros(1, 1, dtype=torch.int32),
                                                  actual_seq_lengths=[1], actual_seq_lengths_kv=[1], num_heads=4,
                                                  num_key_value_heads=2, input_layout="TND", block_size=128)


def test_a_wrong_answer_is_refused(monkeypatch):
    def zeros(a):
        return torch.zeros_like(a["query"]), torch.zeros(1)

    FakeTorchNpu(kernels={FIA: zeros}).install(monkeypatch)
    with pytest.raises(NpuKernelsUnsupported, match=r"answers wrongly: max error"):
        NpuPagedOps().check_kv_spec(_spec(), 4, CPU)


def test_portable_ops_take_any_spec():
    from epdserve.ops.portable import PortableOps

    PortableOps().check_kv_spec(_spec(torch.float16, 80), 4, CPU)


def test_the_engine_asks_before_it_allocates_the_kv_cache(monkeypatch, qwen2_vl_tiny):
    """LLMEngine calls PagedOps.check_kv_spec with the model's spec and heads, before PagedKVCache:
    a refusal stops the engine at start-up, no KV cache allocated."""
    from epdserve.engine import llm_engine
    from epdserve.engine.config import EngineConfig
    from epdserve.ops.portable import PortableOps

    asked, allocated = [], []

    class Refusing(PortableOps):
        def check_kv_spec(self, spec, num_heads, device):
            asked.append((spec.dtype, spec.head_dim, num_heads, str(device)))
            raise NpuKernelsUnsupported("refused at start-up")

    monkeypatch.setattr(llm_engine, "paged_ops", lambda platform, choice=None: Refusing())
    monkeypatch.setattr(llm_engine, "PagedKVCache", lambda *a, **k: allocated.append(a))
    with pytest.raises(NpuKernelsUnsupported, match="refused at start-up"):
        llm_engine.LLMEngine(EngineConfig(model=str(qwen2_vl_tiny), device="cpu"))
    assert asked == [(torch.float32, 16, 4, "cpu")] and allocated == []


def test_a_kv_write_that_misplaces_tokens_is_refused(monkeypatch):
    """The probe runs the engine's KV write and checks where the tokens landed (issue 53 item 3)."""
    from tests.fakes.npu_kernels_fake import KV_WRITES

    def shifted(impl):
        def write(a):  # the right values, one slot off
            a = dict(a)
            for name in ("slot_mapping", "slot_indices"):
                if name in a and torch.is_tensor(a[name]):
                    a[name] = a[name] + 1
            return impl(a)
        return write

    FakeTorchNpu(kernels={FIA: _fia, **{k: shifted(v) for k, v in KV_WRITES.items()}}).install(monkeypatch)
    with pytest.raises(NpuKernelsUnsupported, match="KV cache write put the tokens in the wrong place"):
        NpuPagedOps().check_kv_spec(_spec(), 4, CPU)
