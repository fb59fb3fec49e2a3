"""int4 (W4A16) on an NPU (engine/lm/npu_int4_linear.py) on the fake torch_npu of each line, whose
npu_convert_weight_to_int4pack and npu_weight_quant_batchmatmul compute what op-plugin documents
(tests/fakes/npu_int4_kernels_fake.py): the packing is op-plugin's, the documentation's example
round-trips, the NPU linear equals the dequantized float product and the CPU `Int4Linear` within
bounds derived from the kernels' roundings, a greedy run on the NPU classes gives the CPU run's
tokens, and a torch_npu without the packing operator is refused at start-up naming it."""
from __future__ import annotations

import dataclasses

import pytest
import torch

from epdserve import LLM
from epdserve.engine.lm.int4_linear import GROUP_SIZE, dequantize_int4, quantize_int4
from epdserve.engine.lm.linear import make_linear
from epdserve.engine.lm.npu_int4_linear import NpuInt4Linear
from epdserve.model import demo
from epdserve.ops.npu_schema import NpuKernelsUnsupported
from tests.fakes.npu_int4_kernels_fake import unpack_int4
from tests.fakes.npu_kernels_fake import LINES
from tests.fakes.torch_npu_fake import FakeTorchNpu
from tests.hf_oracle import assert_same_greedy
from tests.ops.test_npu_quant_linear import BF16_NEAR_TIE, LOGPROB_TOL, _greedy, _r

HALF = (torch.bfloat16, torch.float16)


@pytest.fixture(params=LINES)
def fake(request, monkeypatch) -> FakeTorchNpu:
    return FakeTorchNpu(line=request.param).install(monkeypatch)


def op_plugin_pack(v: torch.Tensor) -> torch.Tensor:
    """op-plugin test/test_custom_ops/test_npu_convert_weight_to_int4pack.py `pack_int4_3dim`, 2-D:
    per eight values, two nibbles per byte, the bytes little-end first."""
    out = torch.zeros(v.shape[0], v.shape[1] // 8, dtype=torch.int64)
    for j in range(4):
        byte = (v[:, 2 * j::8].long() & 0x0F) + ((v[:, 2 * j + 1::8].long() & 0x0F) << 4)
        out += byte << (8 * j)
    return torch.where(out >= 2 ** 31, out - 2 ** 32, out).to(torch.int32)


def test_the_packing_is_op_plugins_and_round_trips(fake):
    row = torch.tensor([[1, 2, 3, 4, 5, 6, 7, -8]], dtype=torch.int32)  # value j in bits 4j..4j+3
    assert fake.module.npu_convert_weight_to_int4pack(row).tolist() == [[0x87654321 - 2 ** 32]]
    v = torch.randint(-8, 8, (64, 32), generator=torch.Generator().manual_seed(0), dtype=torch.int32)
    packed = fake.module.npu_convert_weight_to_int4pack(v)
    assert packed.shape == (64, 4) and packed.dtype == torch.int32
    assert torch.equal(packed, op_plugin_pack(v)) and torch.equal(unpack_int4(packed), v)


def test_the_documents_example_runs_as_its_reference_computes(fake):
    """torch_npu-npu_convert_weight_to_int4pack.md's example (m 128, k 64, n 32, fp16, (1, n) scale
    and offset), checked as op-plugin's test of it checks it (`supported_op_exec`, rtol 0.001)."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(128, 64, generator=g).half()
    w = torch.randint(-8, 8, (64, 32), generator=g, dtype=torch.int32)
    scale, offset = torch.randn(1, 32, generator=g).half(), torch.randn(1, 32, generator=g).half()
    got = fake.module.npu_weight_quant_batchmatmul(x, fake.module.npu_convert_weight_to_int4pack(w), scale, offset)
    want = (x.float() @ ((w.half() + offset) * scale).float()).half()
    torch.testing.assert_close(got, want, rtol=1e-3, atol=1e-3 * want.abs().max().item())


def _parts(dtype, k):
    """Two fused parts with a bias on one; the first row's first group all 5.0 (a constant group)."""
    parts = [_r(48, k, dtype=dtype) * 0.05, _r(16, k, dtype=dtype, seed=1)]
    parts[0][0, :GROUP_SIZE] = 5.0
    return parts, [_r(48, dtype=dtype, seed=2), None]


@pytest.mark.parametrize("dtype", HALF)
@pytest.mark.parametrize("k", [GROUP_SIZE, 3 * GROUP_SIZE])
def test_w4a16_is_the_dequantized_product_and_the_cpu_int4_linear_within_their_roundings(fake, dtype, k):
    """deq = (q - 8) · scale + zero (Int4Linear's weights). The NPU computes (q - 8 + offset) · scale
    with offset = zero / scale rounded to the dtype (≤ eps/2 · |zero| per weight), rounds that weight
    to the dtype (≤ eps/2 · |deq|, eps/2 more for the offset's share), sums in fp32 (≤ K · 2⁻²⁴ · R,
    R = |x| · |deq|ᵀ + |b|) and rounds the output (≤ eps/2 of it): E = |x| · (eps/2 · |zero| + eps ·
    |deq|)ᵀ + K · 2⁻²⁴ · R, and |npu - want| ≤ E + eps/2 · (|want| + E). The CPU kernel's own bound
    (tests/engine/test_int4.py): 2K · 2⁻²⁴ · R + 2 eps · R; the two differ by at most both."""
    parts, biases = _parts(dtype, k)
    x = _r(5, k, dtype=dtype, seed=3)
    lin = make_linear(parts, biases, "int4", "npu")
    assert isinstance(lin, NpuInt4Linear)
    q, scales, zeros = quantize_int4(torch.cat(parts))
    assert (scales <= torch.finfo(dtype).tiny).sum() == 1  # the constant group is a flat one
    deq = dequantize_int4(q, scales, zeros, torch.float32)
    bias = torch.cat([biases[0].float(), torch.zeros(16)])
    want = x.float() @ deq.t() + bias
    eps = torch.finfo(dtype).eps
    R = x.float().abs() @ deq.abs().t() + bias.abs()
    E = x.float().abs() @ (eps / 2 * zeros.float().abs().repeat_interleave(GROUP_SIZE, 1) + eps * deq.abs()).t() \
        + k * 2 ** -24 * R
    got = lin(x)
    assert got.dtype == dtype and ((got.float() - want).abs() <= E + eps / 2 * (want.abs() + E)).all()
    cpu = make_linear(parts, biases, "int4")(x)
    assert ((got.float() - cpu.float()).abs() <= E + eps / 2 * (want.abs() + E) + 2 * k * 2 ** -24 * R + 2 * eps * R).all()
    group = GROUP_SIZE if k > GROUP_SIZE else 0  # one group: the document's perchannel form
    bias_dtype = torch.float32 if dtype == torch.bfloat16 else torch.float16
    assert fake.kernel_calls == [
        ("npu_convert_weight_to_int4pack", ((torch.int32, (k, 64), True),), {}),
        ("npu_weight_quant_batchmatmul",
         ((dtype, (5, k), True), (torch.int32, (k, 8), True), (dtype, (k // GROUP_SIZE, 64), True)),
         {"antiquant_offset": (dtype, (k // GROUP_SIZE, 64), True), "bias": (bias_dtype, (64,), True),
          "antiquant_group_size": group})]
    assert torch.equal(lin.w, op_plugin_pack((q - 8).t().contiguous()))  # the signed codes, [in, out] packed on out


def test_a_width_the_packing_cannot_take_is_refused_at_load(fake):
    with pytest.raises(ValueError, match="int4 weights' 12 outputs on this rank in groups of 8"):
        make_linear([torch.ones(12, GROUP_SIZE, dtype=torch.bfloat16)], None, "int4", "npu")


@pytest.fixture(scope="module")
def qwen2_vl_128(tmp_path_factory):
    """The tiny demo widened to whole groups (hidden 128, MLP 256: o_proj, qkv and gate_up take one
    group, down two), small enough for one greedy run per platform."""
    size = dataclasses.replace(demo.PRESETS["tiny"], hidden=128, heads=2, kv_heads=1, intermediate=256,
                               mrope_section=(8, 12, 12))
    with pytest.MonkeyPatch.context() as mp:
        mp.setitem(demo.PRESETS, "int4-npu", size)
        mp.setattr(demo, "SIZES", (*demo.SIZES, "int4-npu"))
        return demo.build_demo_model(tmp_path_factory.mktemp("qwen2_vl_128"), size="int4-npu")


def test_int4_on_the_npu_kernels_generates_the_cpu_runs_tokens(qwen2_vl_128, monkeypatch):
    """As test_npu_quant_linear's msModelSlim run: the LM linears held for the NPU (the platform
    forced to "npu" at load) on the fake torch_npu, bf16, against the CPU's Int4Linear; token for
    token except after a CPU step whose top two were within `BF16_NEAR_TIE`, and the steps both reach
    on the same tokens with top-2 log-probs within `LOGPROB_TOL`."""
    from epdserve.engine import loaded_model

    want, want_lp, cpu_kinds = _greedy(qwen2_vl_128, quantization="int4")
    assert cpu_kinds == {"Int4Linear"}
    fake = FakeTorchNpu().install(monkeypatch)
    read = loaded_model.read_layers
    monkeypatch.setattr(loaded_model, "read_layers", lambda *a, **kw: read(*a, **{**kw, "platform": "npu"}))
    got, got_lp, npu_kinds = _greedy(qwen2_vl_128, quantization="int4")
    assert npu_kinds == {"NpuInt4Linear"} and fake.kernel_calls
    for i, (g, w, glp, wlp) in enumerate(zip(got, want, got_lp, want_lp)):
        assert_same_greedy(g, w, [a - b for a, b in wlp], f"int4 prompt {i} on the NPU kernels vs the CPU's",
                           BF16_NEAR_TIE)
        same = next((j for j, (a, b) in enumerate(zip(g, w)) if a != b), len(g) - 1)
        for j in range(same + 1):
            assert max(abs(a - b) for a, b in zip(glp[j], wlp[j])) <= LOGPROB_TOL, (i, j, glp[j], wlp[j])


@pytest.mark.parametrize("line", LINES)
def test_a_torch_npu_without_the_int4_packing_is_refused_at_start_up_naming_it(qwen2_vl_tiny, monkeypatch, line):
    fake = FakeTorchNpu(line=line, absent=("npu_convert_weight_to_int4pack",)).install(monkeypatch)
    with pytest.raises(NpuKernelsUnsupported, match=f"--quantization int4 on an NPU calls torch_npu."
                                                    f"npu_convert_weight_to_int4pack, which torch_npu {line}\\+fake"):
        LLM(qwen2_vl_tiny, device="npu", dtype="bfloat16", quantization="int4")
    assert not fake.kernel_calls
