"""The quantized linears on an NPU (engine/lm/npu_quant_linear.py, npu_static_w8a8.py) on the fake
torch_npu of each line, whose kernels compute what op-plugin documents
(tests/fakes/npu_quant_kernels_fake.py): each NPU linear equals the CPU one / the product of the
dequantized weights within the kernels' own rounding and makes the documented call; an msModelSlim
checkpoint runs on them with the CPU run's greedy tokens; what the NPU cannot run is refused at
start-up, naming why."""
from __future__ import annotations

import math

import pytest
import torch

from epdserve import LLM, SamplingParams
from epdserve.engine import loaded_model
from epdserve.engine.lm.linear import check_method, make_linear, static_linear
from epdserve.engine.lm.npu_quant_linear import NpuInt8DynamicLinear, NpuInt8Linear
from epdserve.engine.lm.npu_static_w8a8 import NpuStaticW8A8Linear
from epdserve.engine.lm.quant_linear import dequantize_int8, quantize_int8, quantize_rows
from epdserve.engine.lm.static_w8a8 import StaticPart, quantize_per_tensor
from epdserve.ops.npu_quant_schema import METHOD_OPS, check_quant_kernels
from epdserve.ops.npu_schema import NpuKernelsUnsupported
from tests.engine.test_prequantized import modelslim_checkpoint
from tests.engine.test_prequantized_static import calibrate, static_checkpoint
from tests.engine.test_quantization import PROMPTS
from tests.fakes.npu_kernels_fake import LINES
from tests.fakes.torch_npu_fake import FakeTorchNpu
from tests.hf_oracle import assert_same_greedy

HALF = (torch.bfloat16, torch.float16)


@pytest.fixture(params=LINES)
def fake(request, monkeypatch) -> FakeTorchNpu:
    return FakeTorchNpu(line=request.param).install(monkeypatch)


def _r(*shape, dtype=torch.float32, seed=0):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)).to(dtype)


def _near(got: torch.Tensor, want: torch.Tensor, ulps: int) -> bool:
    """|got - want| within `ulps` units in the last place of want's largest magnitude (outputs that
    differ in where they round: a sum's rounding error scales with its terms, not with the sum)."""
    return bool(((got.float() - want.float()).abs() <= ulps * torch.finfo(want.dtype).eps * want.float().abs().max()).all())


def test_every_line_registers_each_methods_kernels_with_our_keywords(fake):
    for method in METHOD_OPS:
        check_quant_kernels(method, fake.module)


def test_the_stand_in_reproduces_the_documents_examples(fake):
    """op-plugin torch_npu-npu_dynamic_quant.md's example (fp16 x, output and scale printed there) and
    torch_npu-npu_quantize.md's A2 one (|x * 0.1| < 0.5: all zeros)."""
    x = torch.tensor([[0.7261, 0.3726, 0.9126], [0.9023, 0.9990, 0.1279], [0.8628, 0.6240, 0.9028]],
                     dtype=torch.float16)
    y, scale = fake.module.npu_dynamic_quant(x)
    assert y.tolist() == [[101, 52, 127], [115, 127, 16], [121, 88, 127]] and y.dtype == torch.int8
    torch.testing.assert_close(scale, torch.tensor([0.0072, 0.0079, 0.0071]), atol=5e-5, rtol=0)
    x = torch.tensor([[[0.9609, 1.3281, -0.6172, 0.5469, -1.1797, -1.1719, -0.7422, 0.9727, -0.9062, -0.0815,
                        -0.8047, 1.0703]]], dtype=torch.bfloat16)
    out = fake.module.npu_quantize(x, torch.tensor([0.1] * 12).bfloat16(), None, torch.qint8, -1, False)
    assert out.dtype == torch.int8 and not out.any()


@pytest.mark.parametrize("dtype", HALF)
def test_w8a16_is_the_weight_quant_matmul_of_the_dequantized_weights(fake, dtype):
    parts, biases = [_r(48, 64, dtype=dtype), _r(16, 64, dtype=dtype, seed=1)], [_r(48, dtype=dtype, seed=2), None]
    x = _r(5, 64, dtype=dtype, seed=3)
    lin = make_linear(parts, biases, "int8", "npu")
    assert isinstance(lin, NpuInt8Linear)
    q, s = quantize_int8(torch.cat(parts))
    bias = torch.cat([biases[0], torch.zeros(16, dtype=dtype)])
    want = (x.float() @ dequantize_int8(q, s, dtype).float().t() + bias.float()).to(dtype)
    got = lin(x)
    assert got.dtype == dtype and torch.equal(got, want)
    cpu = make_linear(parts, biases, "int8")(x)  # torch's CPU kernel: the same products, rounded otherwise
    assert _near(got, cpu, 2)
    bias_dtype = torch.float32 if dtype == torch.bfloat16 else torch.float16  # the document's bias rule
    assert fake.kernel_calls == [("npu_weight_quant_batchmatmul",
                                  ((dtype, (5, 64), True), (torch.int8, (64, 64), False), (dtype, (64,), True)),
                                  {"bias": (bias_dtype, (64,), True)})]


@pytest.mark.parametrize("dtype", HALF)
def test_w8a8_dynamic_is_the_per_token_quant_matmul_and_equals_the_cpu_one(fake, dtype):
    parts, biases = [_r(40, 96, dtype=dtype), _r(24, 96, dtype=dtype, seed=1)], [None, _r(24, dtype=dtype, seed=2)]
    x = _r(7, 96, dtype=dtype, seed=3)
    lin = make_linear(parts, biases, "w8a8", "npu")
    assert isinstance(lin, NpuInt8DynamicLinear)
    q, s = quantize_int8(torch.cat(parts))
    xq, sx = quantize_rows(x)  # the CPU's per-token rounding: the same grid as npu_dynamic_quant's
    bias = torch.cat([torch.zeros(40, dtype=dtype), biases[1]])
    want = ((xq.long() @ q.long().t()).float() * sx * s.float() + bias.float()).to(dtype)
    got = lin(x)
    assert got.dtype == dtype and _near(got, want, 1)
    cpu = make_linear(parts, biases, "w8a8")(x)  # adds the bias after rounding: one rounding more
    assert _near(got, cpu, 2)
    assert [c[0] for c in fake.kernel_calls] == ["npu_dynamic_quant", "npu_quant_matmul"]
    args, kwargs = fake.kernel_calls[1][1:]
    assert args == ((torch.int8, (7, 96), True), (torch.int8, (96, 64), True), (torch.float32, (64,), True))
    assert kwargs == {"pertoken_scale": (torch.float32, (7,), True), "bias": (torch.float32, (64,), True),
                      "output_dtype": dtype}


def _static_parts(seed=0):
    """q/k/v-like parts: two calibrated alike (one run), one apart; the last without quant_bias.
    Power-of-two input scales: their reciprocals are exact in bf16 / fp16, so the NPU's reciprocal in
    the model dtype equals the CPU's fp32 one."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for i, (n, scale, offset) in enumerate([(32, 2.0 ** -5, 7), (16, 2.0 ** -5, 7), (16, 2.0 ** -4, -9)]):
        q = torch.randint(-127, 128, (n, 64), generator=g, dtype=torch.int8)
        qb = torch.randint(-3000, 3000, (n,), generator=g, dtype=torch.int32) if i < 2 else None
        out.append(StaticPart(q, scale, offset, torch.rand(n, generator=g) * 1e-3, qb))
    return out


@pytest.mark.parametrize("dtype", HALF)
def test_static_w8a8_is_quantize_then_quant_matmul_and_equals_the_cpu_one(fake, dtype):
    parts = _static_parts()
    x = (_r(6, 64, seed=4) * 2).to(dtype)
    lin = static_linear(parts, dtype, "npu")
    assert isinstance(lin, NpuStaticW8A8Linear) and len(lin.runs) == 2
    got, cpu = lin(x), static_linear(parts, dtype)(x)
    assert got.dtype == dtype and torch.equal(got, cpu)
    assert [c[0] for c in fake.kernel_calls] == ["npu_quantize", "npu_quant_matmul"] * 2
    (qargs, qkw), (margs, mkw) = fake.kernel_calls[0][1:], fake.kernel_calls[1][1:]
    assert qargs == ((dtype, (6, 64), True), (dtype, (64,), True), (dtype, (64,), True), torch.qint8, -1, False)
    assert qkw == {}
    assert margs == ((torch.int8, (6, 64), True), (torch.int8, (64, 48), True), (torch.float32, (48,), True))
    assert mkw == {"bias": (torch.int32, (48,), True), "output_dtype": dtype}
    assert fake.kernel_calls[3][2]["bias"] is None  # the part without quant_bias adds none


BF16_NEAR_TIE = 0.1  # a top-2 log-prob margin within which one bf16 rounding of the activations may flip greedy
# the top-2 log-probs of a step both runs reach with the same tokens: one bf16 rounding apart at most
# (identical to 1e-3 here; a scale applied twice moves them by 0.3 and more)
LOGPROB_TOL = 0.1


@pytest.mark.parametrize("dtype", HALF)
def test_static_w8a8_with_any_scale_is_one_step_from_the_cpu_grid_at_most(fake, dtype):
    """A scale whose reciprocal the model dtype rounds: npu_quantize's int8 activations are the CPU's
    (fp32 reciprocal) or one step from them, never more."""
    x = (_r(64, 256, seed=5) * 3).to(dtype)
    scale, offset = 0.0237, -11
    recip = (torch.tensor(1.0) / torch.tensor(scale)).to(dtype).repeat(256)
    npu = fake.module.npu_quantize(x, recip, torch.full((256,), float(offset), dtype=dtype), torch.qint8, -1, False)
    cpu = quantize_per_tensor(x, scale, offset)
    diff = (npu.int() - cpu.int()).abs()
    assert diff.max() == 1 and (diff == 0).float().mean() > 0.9


def _greedy(model, **kw):
    """Greedy tokens per prompt, each step's top-2 log-probs, and the LM linears' classes (bf16)."""
    llm = LLM(str(model), device="cpu", dtype="bfloat16", kv_cache_bytes=8 << 20, **kw)
    try:
        inputs = [{"prompt": p, "multi_modal_data": {"image": imgs}} if imgs else p for p, imgs in PROMPTS]
        outs = llm.generate(inputs, SamplingParams(max_tokens=10, ignore_eos=True, logprobs=2))
        top2 = [[t.top_logprobs for t in o.outputs[0].logprobs] for o in outs]
        kinds = {type(lin).__name__ for layer in llm.engine.model.lm.layers for lin in (layer.qkv, layer.o, layer.down)}
        return [list(o.outputs[0].token_ids) for o in outs], top2, kinds
    finally:
        llm.engine.close()


@pytest.fixture(scope="module")
def checkpoints(qwen2_vl_tiny, tmp_path_factory):
    """msModelSlim checkpoints of the tiny demo; the static one's input scales rounded to powers of two,
    whose reciprocals bf16 holds exactly (vllm-ascend's npu_quantize call takes the reciprocal in the
    model dtype, the CPU keeps it in fp32: any other scale moves some activations one step, see
    test_static_w8a8_with_any_scale_is_one_step_from_the_cpu_grid_at_most)."""
    root = tmp_path_factory.mktemp("npu-ms")
    calib = {k: (2.0 ** round(math.log2(scale)), offset) for k, (scale, offset) in calibrate(qwen2_vl_tiny).items()}
    return {"W8A8_DYNAMIC": modelslim_checkpoint(qwen2_vl_tiny, root / "dynamic"),
            "W8A16": modelslim_checkpoint(qwen2_vl_tiny, root / "w8a16", kind="W8A16"),
            "mixed": static_checkpoint(qwen2_vl_tiny, root / "mixed", calib, dynamic_down=True)}


@pytest.mark.parametrize("kind, classes", [
    ("W8A8_DYNAMIC", {"NpuInt8DynamicLinear"}), ("W8A16", {"NpuInt8Linear"}),
    ("mixed", {"NpuStaticW8A8Linear", "NpuInt8DynamicLinear"})])
def test_an_msmodelslim_checkpoint_on_the_npu_kernels_generates_the_cpu_runs_tokens(
        checkpoints, monkeypatch, kind, classes):
    """The engine on the CPU with its LM linears held for the NPU (the engine's platform decides the
    class at load: forced to "npu" here) on the fake torch_npu, in bf16, against the CPU kernels. Bound:
    token for token, except after a step where the CPU run's own top two were within `BF16_NEAR_TIE`
    (the kernels round differently by one bf16 rounding per output: the bias added before or after
    it, the static reciprocal in bf16; these tiny random models have top-2 margins down to 0), and
    every step reached on the same tokens has the same top-2 log-probs within `LOGPROB_TOL`."""
    want, want_lp, cpu_kinds = _greedy(checkpoints[kind])
    assert not any(k.startswith("Npu") for k in cpu_kinds)
    fake = FakeTorchNpu().install(monkeypatch)
    read = loaded_model.read_layers
    monkeypatch.setattr(loaded_model, "read_layers", lambda *a, **kw: read(*a, **{**kw, "platform": "npu"}))
    got, got_lp, npu_kinds = _greedy(checkpoints[kind])
    assert npu_kinds == classes and fake.kernel_calls
    for i, (g, w, glp, wlp) in enumerate(zip(got, want, got_lp, want_lp)):
        assert_same_greedy(g, w, [a - b for a, b in wlp], f"{kind} prompt {i} on the NPU kernels vs the CPU's",
                           BF16_NEAR_TIE)
        same = next((j for j, (a, b) in enumerate(zip(g, w)) if a != b), len(g) - 1)
        for j in range(same + 1):  # the steps both runs reach on the same tokens (the first parted one included)
            assert max(abs(a - b) for a, b in zip(glp[j], wlp[j])) <= LOGPROB_TOL, (kind, i, j, glp[j], wlp[j])


def test_what_the_npu_cannot_run_is_refused_at_start_up(qwen2_vl_tiny, monkeypatch):
    with pytest.raises(ValueError, match="fp16 or bf16 activations only, not torch.float32"):
        check_method("w8a8", "npu", torch.float32)
    assert check_method("w8a8", "npu", torch.bfloat16) == "w8a8"
    with pytest.raises(ValueError, match="quantization=int4 runs on cpu, cuda only"):
        check_method("int4", "npu", torch.bfloat16)
    FakeTorchNpu().install(monkeypatch)
    with pytest.raises(ValueError, match="npu_weight_quant_batchmatmul takes K and N up to 65535"):
        make_linear([torch.ones(65536, 8, dtype=torch.bfloat16)], None, "int8", "npu")
    with pytest.raises(ValueError, match="npu_quant_matmul takes K and N up to 65535"):
        make_linear([torch.ones(8, 65536, dtype=torch.bfloat16)], None, "w8a8", "npu")
    for line in LINES:
        fake = FakeTorchNpu(line=line, absent=("npu_quant_matmul",)).install(monkeypatch)
        with pytest.raises(NpuKernelsUnsupported,
                           match=f"calls torch_npu.npu_quant_matmul, which torch_npu {line}\\+fake does not register"):
            LLM(qwen2_vl_tiny, device="npu", dtype="bfloat16", quantization="w8a8")
        assert not fake.kernel_calls
