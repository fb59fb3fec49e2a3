"""int8 and int4 weight-only (W8A16, W4A16) on CUDA (issue 49): the Triton GEMMs
(ops/triton_int8_mm.py, ops/triton_int4_mm.py) on this CPU through Triton's interpreter against the
dequantized float product within their derived bounds (fp32 and bf16; fp16 in the start-up
checks' one case each; K (int8) and N not
multiples of the blocks; 1, 3 and 33 rows; with and without a bias; int8's weights read through
either layout); CUDA choosing `CudaInt8Linear` / `CudaInt4Linear` and still refusing w8a8 by name;
the start-up checks (engine/lm/cuda_quant_linear.py, cuda_int4_linear.py) refusing a kernel that
fails, or runs and is wrong."""
from pathlib import Path

import pytest
import torch

from epdserve.engine.lm.cuda_int4_linear import CudaInt4Linear, check_cuda_int4, dequantized
from epdserve.engine.lm.cuda_quant_linear import CudaInt8Linear, check_cuda_int8
from epdserve.engine.lm.int4_linear import GROUP_SIZE, Int4Linear
from epdserve.engine.lm.linear import CUDA_LINEAR_METHODS, check_method, linear_class
from epdserve.engine.lm.npu_quant_linear import NpuInt8Linear
from epdserve.engine.lm.quant_linear import Int8Linear
from tests.ops.interpreter import interpreted_rows

CASES = Path(__file__).with_name("cuda_quant_linear_cases.py")


def test_the_kernel_is_within_its_bound_of_the_dequantized_product_in_the_interpreter():
    rows = interpreted_rows(CASES)
    assert rows.pop() == {"startup_check": "ok"}  # check_cuda_int8 with the real kernel, as at start-up
    assert len(rows) == 24, rows  # (int8, int4) x (fp32, bf16) x 3 row counts x bias or not
    for r in rows:
        assert r["dtype_ok"] and r["shape_ok"], r
        assert r["over"] <= 0, r  # within int8_bound of x · (q · scale)ᵀ + bias
        assert r["cpu_over"] <= 0, r  # the CPU class within twice that bound: the two agree
        assert r["strided_equal"], r  # q read as [N, K] or through a [K, N] layout: the same output


def test_cuda_takes_the_triton_classes_and_refuses_what_it_has_no_kernel_for():
    assert linear_class("int8", "cuda") is CudaInt8Linear is CUDA_LINEAR_METHODS["int8"]
    assert linear_class("int4", "cuda") is CudaInt4Linear is CUDA_LINEAR_METHODS["int4"]
    assert issubclass(CudaInt8Linear, Int8Linear)  # method_of names it "int8"; prequantized W8A16 loads into it
    assert issubclass(CudaInt4Linear, Int4Linear)  # method_of names it "int4"
    assert linear_class("int8", "cpu") is Int8Linear and linear_class("int8", "npu") is NpuInt8Linear
    assert linear_class("int4", "cpu") is Int4Linear
    for method in ("int8", "int4"):
        assert check_method(method, "cuda", torch.bfloat16) == method
        assert check_method(method, "cuda", torch.float32) == method  # the kernels take fp32 too ("ieee" dots)
    with pytest.raises(ValueError, match="quantization=w8a8 runs on .* no CUDA kernel here yet: on CUDA use int8 or "
                                         "int4 .*not on cuda"):
        check_method("w8a8", "cuda")
    with pytest.raises(ValueError, match="quantization=fp8 runs on cpu, cuda only .*not on npu"):
        check_method("fp8", "npu")


def _tf32(t):
    """`t` (fp32) with its mantissa rounded to TF32's 10 bits: what tensor cores make of fp32 operands
    at Triton's default dot precision, which the kernels must not use for an fp32 model."""
    b = t.float().contiguous().view(torch.int32)
    return ((b + 0x1000) & ~0x1FFF).view(torch.float32)


def _reference(x, q, scales, bias=None):
    out = (x.float() @ (q.float() * scales.float()[:, None]).t())
    return (out if bias is None else out + bias.float()).to(x.dtype)


def test_the_startup_check_refuses_a_kernel_that_fails_or_strays():
    check_cuda_int8("cpu", torch.bfloat16, kernel=_reference)  # a correct product passes

    def fails(*_):
        raise RuntimeError("PTX compile failed")  # what a Triton that cannot build it for this GPU raises

    with pytest.raises(ValueError, match="int8 Triton kernel does not run on cpu \\(RuntimeError: PTX compile "
                                         "failed\\): serve --quantization fp8 .* or leave --quantization out"):
        check_cuda_int8("cpu", torch.bfloat16, kernel=fails)
    wrong = {"scale skipped": lambda x, q, s, b: _reference(x, q, torch.ones_like(s), b),
             "bias dropped": lambda x, q, s, b: _reference(x, q, s),
             "zeros": lambda x, q, s, b: torch.zeros(x.shape[0], q.shape[0], dtype=x.dtype),
             "NaN": lambda x, q, s, b: _reference(x, q, s, b).fill_(float("nan")),
             "transposed": lambda x, q, s, b: _reference(x, q, s, b).t()}
    for name, kernel in wrong.items():
        with pytest.raises(ValueError, match="int8 Triton kernel's product on cpu .* differs from the dequantized "
                                             "float product past its bound: serve --quantization fp8"):
            check_cuda_int8("cpu", torch.bfloat16, kernel=kernel)
            pytest.fail(name)
    # subtle: an fp32 model's product through TF32 operands (the bound is tight enough to see it)
    check_cuda_int8("cpu", torch.float32, kernel=_reference)
    with pytest.raises(ValueError, match="past its bound"):
        check_cuda_int8("cpu", torch.float32, kernel=lambda x, q, s, b: _reference(_tf32(x), q, s, b))


def _reference4(x, packed, sz, group, bias=None):
    q = torch.stack([packed & 0xF, packed >> 4], dim=-1).reshape(packed.shape[0], -1)  # pack_int4's inverse
    out = x.float() @ dequantized(q, sz, group).t()
    return (out if bias is None else out + bias.float()).to(x.dtype)


def _pack(q):
    q = q.to(torch.uint8)
    return q[:, 0::2] | (q[:, 1::2] << 4)


def test_the_int4_startup_check_refuses_a_kernel_that_fails_or_strays():
    check_cuda_int4("cpu", torch.bfloat16, kernel=_reference4, pack=_pack)  # a correct product passes

    def fails(*_):
        raise RuntimeError("PTX compile failed")

    with pytest.raises(ValueError, match="int4 Triton kernel does not run on cpu \\(RuntimeError: PTX compile "
                                         "failed\\): serve --quantization int8, fp8"):
        check_cuda_int4("cpu", torch.bfloat16, kernel=fails, pack=_pack)
    wrong = {"zero dropped": lambda x, p, sz, g, b: _reference4(x, p, sz * torch.tensor([1.0, 0.0]).to(sz.dtype), g, b),
             "codes not less 8": lambda x, p, sz, g, b: _reference4(x, p, sz, g, b) + (8 * x.float().sum(1, True)
                                                                                  * sz[0, :, 0].float()).to(x.dtype),
             "nibbles swapped": lambda x, p, sz, g, b: _reference4(x, (p << 4) | (p >> 4), sz, g, b)}
    assert GROUP_SIZE == 128  # the check's two groups
    for name, kernel in wrong.items():
        with pytest.raises(ValueError, match="int4 Triton kernel's product on cpu .* past its bound"):
            check_cuda_int4("cpu", torch.bfloat16, kernel=kernel, pack=_pack)
            pytest.fail(name)
    check_cuda_int4("cpu", torch.float32, kernel=_reference4, pack=_pack)
    with pytest.raises(ValueError, match="past its bound"):  # subtle: an fp32 model's activations through TF32
        check_cuda_int4("cpu", torch.float32, kernel=lambda x, p, sz, g, b: _reference4(_tf32(x), p, sz, g, b),
                        pack=_pack)
