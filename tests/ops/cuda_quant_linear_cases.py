"""Run with TRITON_INTERPRET=1 (tests/ops/test_cuda_quant_linear.py starts it so): the Triton W8A16
and W4A16 GEMMs (ops/triton_int8_mm.py, ops/triton_int4_mm.py) against the dequantized float
product on the cases below, through `CudaInt8Linear` / `CudaInt4Linear` as the engine calls them
(int8 also through the kernel on a [K, N]-strided weight view), beside the CPU classes; prints one
JSON line per case with the largest error past the derived bound (<= 0: within it)."""
import json
import os

assert os.environ.get("TRITON_INTERPRET") == "1", "Triton reads TRITON_INTERPRET when the kernel is decorated"

import torch  # noqa: E402

from epdserve.engine.lm.cuda_int4_linear import CudaInt4Linear, check_cuda_int4, dequantized, int4_bound  # noqa: E402
from epdserve.engine.lm.cuda_quant_linear import CudaInt8Linear, check_cuda_int8, int8_bound  # noqa: E402
from epdserve.engine.lm.int4_linear import Int4Linear, quantize_int4  # noqa: E402
from epdserve.engine.lm.quant_linear import Int8Linear  # noqa: E402
from epdserve.ops.triton_int8_mm import int8_weight_mm  # noqa: E402

K, N = 200, 70  # neither a multiple of the 64-wide blocks: the last K and N tiles are masked
gen = torch.Generator().manual_seed(0)
for dtype in (torch.float32, torch.bfloat16):  # fp16: the start-up checks below
    for rows in (1, 3, 33):
        for with_bias in (False, True):
            w = torch.randn(N, K, generator=gen).to(dtype)
            b = torch.randn(N, generator=gen).to(dtype) if with_bias else None
            x = torch.randn(rows, K, generator=gen).mul(2).to(dtype)
            lin = CudaInt8Linear([w], [b])
            want = x.float() @ (lin.q.float() * lin.scales.float()[:, None]).t()
            if b is not None:
                want += b.float()
            bound = int8_bound(x, lin.q, lin.scales, b)
            got = lin(x)
            cpu = Int8Linear([w], [b])(x)  # the CPU class on the same weights: same dtype, same bound
            strided = int8_weight_mm(x, lin.q.t().contiguous().t(), lin.scales, b)  # q read through a [K, N] layout
            print(json.dumps({
                "case": f"{str(dtype)[6:]}-m{rows}-{'bias' if with_bias else 'nobias'}",
                "dtype_ok": got.dtype == dtype, "shape_ok": list(got.shape) == [rows, N],
                "over": ((got.float() - want).abs() - bound).max().item(),
                "cpu_over": ((cpu.float() - want).abs() - 2 * bound).max().item(),
                "strided_equal": torch.equal(strided, got)}))

# int4: K = 2 groups of 128 (a whole number of groups: Int4Linear refuses others); N = 80, not a
# multiple of the 64-wide N block (and a multiple of 16, which the CPU class's packing needs)
K4, N4 = 256, 80
for dtype in (torch.float32, torch.bfloat16):  # fp16: the start-up checks below
    for rows in (1, 3, 33):
        for with_bias in (False, True):
            w = torch.randn(N4, K4, generator=gen).to(dtype)
            b = torch.randn(N4, generator=gen).to(dtype) if with_bias else None
            x = torch.randn(rows, K4, generator=gen).mul(2).to(dtype)
            lin = CudaInt4Linear([w], [b])
            q = quantize_int4(w)[0]
            want = x.float() @ dequantized(q, lin.scales_zeros, lin.group).t()
            if b is not None:
                want += b.float()
            bound = int4_bound(x, q, lin.scales_zeros, lin.group, b)
            got = lin(x)
            cpu = Int4Linear([w], [b])(x)
            print(json.dumps({
                "case": f"int4-{str(dtype)[6:]}-m{rows}-{'bias' if with_bias else 'nobias'}",
                "dtype_ok": got.dtype == dtype, "shape_ok": list(got.shape) == [rows, N4],
                "over": ((got.float() - want).abs() - bound).max().item(),
                "cpu_over": ((cpu.float() - want).abs() - 2 * bound).max().item(),
                "strided_equal": True}))

# the start-up checks an engine runs on its device (engine/lm/cuda_quant_linear.py, cuda_int4_linear.py):
# pass with the kernels as they are
for dtype in (torch.float32, torch.bfloat16, torch.float16):
    check_cuda_int8("cpu", dtype)
    check_cuda_int4("cpu", dtype)
print(json.dumps({"startup_check": "ok"}))
