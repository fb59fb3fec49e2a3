"""The Triton paged decode-attention kernel (ops/triton_decode.py, issue 52 item 4) on this CPU
through Triton's interpreter, against the portable gather + SDPA (fp32 and bf16; GQA and MHA;
block-boundary crossings, scattered block tables, ragged contexts, a head_dim that is not a power
of two, an empty row); and CUDA choosing it (ops/select.py)."""
from pathlib import Path

from epdserve.ops.select import paged_ops
from epdserve.platform.cuda import CudaPlatform
from tests.ops.interpreter import interpreted_rows

CASES = Path(__file__).with_name("triton_decode_cases.py")


def test_the_kernel_equals_the_portable_op_in_the_interpreter():
    rows = interpreted_rows(CASES)
    assert rows.pop() == {"startup_check": "ok"}  # TritonOps.check_kv_spec: the kernel run once, as at start-up
    assert len(rows) == 10, rows
    for r in rows:
        assert r["shape_ok"] and r["empty_rows_zero"], r
        assert r["err"] <= r["bound"], r


def test_cuda_takes_the_triton_decode_unless_told_portable():
    ops = paged_ops(CudaPlatform())  # the selection reads the platform's name: no GPU needed
    assert ops.name == "triton" and type(ops).__name__ == "TritonOps"
    assert paged_ops(CudaPlatform(), "portable").name == "portable"


def test_the_startup_check_refuses_a_kernel_that_fails_or_disagrees():
    import pytest
    import torch

    from epdserve.engine.kv_cache import KVCacheSpec
    from epdserve.ops.triton_ops import TritonOps

    spec = KVCacheSpec(2, 2, 24, 16, torch.float32)
    ops = TritonOps()
    ops._decode = lambda q, *rest: torch.zeros_like(q)  # a kernel that runs and is wrong
    with pytest.raises(ValueError, match="differs from the portable op's .* EPDSERVE_OPS=portable"):
        ops.check_kv_spec(spec, 6, "cpu")

    def fails(*_):
        raise RuntimeError("PTX compile failed")  # what a Triton that cannot build it for this GPU raises

    ops._decode = fails
    with pytest.raises(ValueError, match="does not run here \\(RuntimeError: PTX compile failed\\)"):
        ops.check_kv_spec(spec, 6, "cpu")
    with pytest.raises(ValueError, match="power-of-two KV block size, got 24"):
        ops.check_kv_spec(KVCacheSpec(2, 2, 24, 24, torch.float32), 6, "cpu")
