"""int8 weight-only (W8A16) on CUDA (issue 49): the Triton GEMM (ops/triton_int8_mm.py) on this CPU
through Triton's interpreter against the dequantized float product within its derived bound (fp32,
bf16, fp16; K and N not multiples of the blocks; 1, 3 and 33 rows; with and without a bias; the
weights read through either layout); CUDA choosing `CudaInt8Linear` for int8 and still refusing
w8a8 and int4 by name; the start-up check (engine/lm/cuda_quant_linear.py) refusing a kernel that
fails, or runs and is wrong."""
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from epdserve.engine.lm.cuda_quant_linear import CudaInt8Linear, check_cuda_int8
from epdserve.engine.lm.linear import CUDA_LINEAR_METHODS, check_method, linear_class
from epdserve.engine.lm.npu_quant_linear import NpuInt8Linear
from epdserve.engine.lm.quant_linear import Int8Linear

CASES = Path(__file__).with_name("cuda_quant_linear_cases.py")


def test_the_kernel_is_within_its_bound_of_the_dequantized_product_in_the_interpreter():
    root = Path(__file__).parents[2]  # first on the path: this checkout's epdserve, not an installed one
    env = {**os.environ, "TRITON_INTERPRET": "1",
           "PYTHONPATH": os.pathsep.join(p for p in (str(root), os.environ.get("PYTHONPATH")) if p)}
    out = subprocess.run([sys.executable, str(CASES)], env=env, capture_output=True, text=True, timeout=300, cwd=root)
    assert out.returncode == 0, out.stderr[-3000:]
    rows = [json.loads(line) for line in out.stdout.splitlines() if line.startswith("{")]
    assert rows.pop() == {"startup_check": "ok"}  # check_cuda_int8 with the real kernel, as at start-up
    assert len(rows) == 18, out.stdout  # 3 dtypes x 3 row counts x bias or not
    for r in rows:
        assert r["dtype_ok"] and r["shape_ok"], r
        assert r["over"] <= 0, r  # within int8_bound of x · (q · scale)ᵀ + bias
        assert r["cpu_over"] <= 0, r  # the CPU class within twice that bound: the two agree
        assert r["strided_equal"], r  # q read as [N, K] or through a [K, N] layout: the same output


def test_cuda_takes_the_triton_int8_class_and_refuses_what_it_has_no_kernel_for():
    assert linear_class("int8", "cuda") is CudaInt8Linear is CUDA_LINEAR_METHODS["int8"]
    assert issubclass(CudaInt8Linear, Int8Linear)  # method_of names it "int8"; prequantized W8A16 loads into it
    assert linear_class("int8", "cpu") is Int8Linear and linear_class("int8", "npu") is NpuInt8Linear
    assert check_method("int8", "cuda", torch.bfloat16) == "int8"
    assert check_method("int8", "cuda", torch.float32) == "int8"  # the kernel takes fp32 too (at "ieee" precision)
    for method in ("w8a8", "int4"):
        with pytest.raises(ValueError, match=f"quantization={method} runs on .* no CUDA kernel here yet: on CUDA use "
                                             f"int8.*not on cuda"):
            check_method(method, "cuda")


def _reference(x, q, scales, bias=None):
    out = (x.float() @ (q.float() * scales.float()[:, None]).t())
    return (out if bias is None else out + bias.float()).to(x.dtype)


def test_the_startup_check_refuses_a_kernel_that_fails_or_strays():
    check_cuda_int8("cpu", torch.bfloat16, kernel=_reference)  # a correct product passes

    def fails(*_):
        raise RuntimeError("PTX compile failed")  # what a Triton that cannot build it for this GPU raises

    with pytest.raises(ValueError, match="does not run on cpu \\(RuntimeError: PTX compile failed\\): leave "
                                         "--quantization out"):
        check_cuda_int8("cpu", torch.bfloat16, kernel=fails)
    wrong = {"scale skipped": lambda x, q, s, b: _reference(x, q, torch.ones_like(s), b),
             "bias dropped": lambda x, q, s, b: _reference(x, q, s),
             "zeros": lambda x, q, s, b: torch.zeros(x.shape[0], q.shape[0], dtype=x.dtype),
             "NaN": lambda x, q, s, b: _reference(x, q, s, b).fill_(float("nan")),
             "transposed": lambda x, q, s, b: _reference(x, q, s, b).t()}
    for name, kernel in wrong.items():
        with pytest.raises(ValueError, match="differs from the dequantized float product past its bound: leave "
                                             "--quantization out"):
            check_cuda_int8("cpu", torch.bfloat16, kernel=kernel)
            pytest.fail(name)
