"""`NpuLayerOps` (ops/npu_layer_ops.py) on the fake torch_npu of each line: each LayerOps call is
the fused kernel with the arguments its schema takes, and equals `PortableLayerOps` (the
transformers arithmetic) within the kernel's own rounding (tests/fakes/npu_layer_kernels_fake.py
computes as the kernels' sources do); what a kernel does not take goes to the portable op."""
from __future__ import annotations

import pytest
import torch

from epdserve.ops.layer_ops import PortableLayerOps
from epdserve.ops.npu_layer_ops import KERNELS, NpuLayerOps
from tests.fakes.npu_kernels_fake import LINES
from tests.fakes.torch_npu_fake import FakeTorchNpu

TOL = {torch.float32: dict(atol=1e-5, rtol=1e-5), torch.float16: dict(atol=2e-3, rtol=2e-3),
       torch.bfloat16: dict(atol=2e-2, rtol=2e-2)}
DTYPES = list(TOL)


@pytest.fixture(params=LINES)
def fake(request, monkeypatch) -> FakeTorchNpu:
    return FakeTorchNpu(line=request.param).install(monkeypatch)


def _r(*shape, dtype, seed=0):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)).to(dtype)


def _names(fake):
    return [c[0] for c in fake.kernel_calls]


def test_every_line_registers_the_four_kernels(fake):
    assert NpuLayerOps().kernels == KERNELS


@pytest.mark.parametrize("dtype", DTYPES)
def test_add_rms_norm_is_the_fused_kernel_and_matches_portable(fake, dtype):
    x, res, w = _r(5, 64, dtype=dtype), _r(5, 64, dtype=dtype, seed=1), _r(64, dtype=dtype, seed=2)
    want_n, want_s = PortableLayerOps().add_rms_norm(x.clone(), res.clone(), w, 1e-6)
    normed, summed = NpuLayerOps().add_rms_norm(x, res, w, 1e-6)
    torch.testing.assert_close(summed, want_s, **TOL[dtype])
    torch.testing.assert_close(normed, want_n, **TOL[dtype])
    assert fake.kernel_calls == [("npu_add_rms_norm", ((dtype, (5, 64), True), (dtype, (5, 64), True),
                                                       (dtype, (64,), True), 1e-6), {})]


@pytest.mark.parametrize("dtype", DTYPES)
def test_rms_norm_and_no_residual_yet(fake, dtype):
    x, w = _r(3, 4, 32, dtype=dtype), _r(32, dtype=dtype, seed=3)  # Qwen3's q/k norm: per head
    torch.testing.assert_close(NpuLayerOps().rms_norm(x, w, 1e-6), PortableLayerOps().rms_norm(x, w, 1e-6), **TOL[dtype])
    normed, summed = NpuLayerOps().add_rms_norm(x[0], None, w, 1e-6)
    assert summed is x[0] or torch.equal(summed, x[0])
    assert _names(fake) == ["npu_rms_norm", "npu_rms_norm"]


@pytest.mark.parametrize("dtype", DTYPES)
def test_rotary_is_bsnd_with_one_batch_and_matches_portable(fake, dtype):
    T, H, KVH, d = 7, 4, 2, 64
    qkv = _r(T, (H + 2 * KVH) * d, dtype=dtype)
    q, k = qkv[:, :H * d].view(T, H, d), qkv[:, H * d:(H + KVH) * d].view(T, KVH, d)  # strided token dim
    pos = torch.arange(T)[:, None] * (1.0 / 10000 ** (torch.arange(0, d, 2) / d))[None]
    emb = torch.cat((pos, pos), dim=-1)
    cos, sin = emb.cos().to(dtype), emb.sin().to(dtype)
    want_q, want_k = PortableLayerOps().rotary(q.clone(), k.clone(), cos, sin)
    got_q, got_k = NpuLayerOps().rotary(q, k, cos, sin)
    torch.testing.assert_close(got_q, want_q, **TOL[dtype])
    torch.testing.assert_close(got_k, want_k, **TOL[dtype])
    r = (dtype, (1, T, 1, d), True)
    assert fake.kernel_calls == [("npu_rotary_mul", ((dtype, (1, T, H, d), True), r, r), {}),
                                 ("npu_rotary_mul", ((dtype, (1, T, KVH, d), True), r, r), {})]


@pytest.mark.parametrize("dtype", DTYPES)
def test_silu_and_mul_is_swiglu(fake, dtype):
    x = _r(6, 2 * 48, dtype=dtype)
    torch.testing.assert_close(NpuLayerOps().silu_and_mul(x), PortableLayerOps().silu_and_mul(x), **TOL[dtype])
    assert fake.kernel_calls == [("npu_swiglu", ((dtype, (6, 96), True), -1), {})]


def test_what_a_kernel_does_not_take_is_portable(fake):
    ops, port = NpuLayerOps(), PortableLayerOps()
    big = _r(3, 2, 896, dtype=torch.bfloat16)  # D < 896 only (torch_npu-npu_rotary_mul.md)
    cs = _r(3, 896, dtype=torch.bfloat16, seed=1)
    assert all(torch.equal(a, b) for a, b in zip(ops.rotary(big, big, cs, cs), port.rotary(big, big, cs, cs)))
    x, w32 = _r(2, 16, dtype=torch.bfloat16), _r(16, dtype=torch.float32)  # gamma of another dtype
    assert torch.equal(ops.rms_norm(x, w32, 1e-6), port.rms_norm(x, w32, 1e-6))
    assert torch.equal(ops.silu_and_mul(_r(2, 8, dtype=torch.float64)), port.silu_and_mul(_r(2, 8, dtype=torch.float64)))
    assert fake.kernel_calls == []


def test_the_fake_kernel_refuses_what_the_doc_refuses(fake):
    import torch_npu

    x = _r(1, 3, 2, 896, dtype=torch.bfloat16)
    with pytest.raises(RuntimeError, match="D must be even and < 896"):
        torch_npu.npu_rotary_mul(x, x, x)
    three = _r(3, 2, 64, dtype=torch.bfloat16)
    if fake.line == "2.8.0":  # op-plugin 7.2.0's doc: 4-D input only
        with pytest.raises(RuntimeError, match="must be 4-D"):
            torch_npu.npu_rotary_mul(three, three, three)
    else:
        torch_npu.npu_rotary_mul(three, three, three)


def test_without_the_kernels_everything_is_portable(monkeypatch):
    fake = FakeTorchNpu().install(monkeypatch)
    monkeypatch.setattr("epdserve.ops.npu_layer_ops.op_arguments", lambda ns, name: None)
    ops = NpuLayerOps()
    assert ops.kernels == ()
    x, w = _r(2, 16, dtype=torch.bfloat16), _r(16, dtype=torch.bfloat16)
    assert torch.equal(ops.add_rms_norm(x, x, w, 1e-6)[0], PortableLayerOps().add_rms_norm(x, x, w, 1e-6)[0])
    assert fake.kernel_calls == []


def test_rotary_tables_outside_the_documented_range_take_the_portable_rotary(fake, caplog):
    """op-plugin's npu_rotary_mul doc bounds r1 / r2 to [-1, 1]: a rope whose attention scaling
    lifts the tables above 1 gets the portable rotary, and one warning (issue 53 item 4)."""
    T, H, d = 5, 2, 64
    q, k = _r(T, H, d, dtype=torch.bfloat16), _r(T, H, d, dtype=torch.bfloat16, seed=1)
    cos, sin = _r(T, d, dtype=torch.bfloat16, seed=2) * 1.2, _r(T, d, dtype=torch.bfloat16, seed=3)
    ops = NpuLayerOps()
    ops.rotary_range(1.0)  # the usual rope: the kernel
    ops.rotary(q, k, cos, sin)
    assert [c[0] for c in fake.kernel_calls] == ["npu_rotary_mul"] * 2
    fake.kernel_calls.clear()
    ops.rotary_range(1.2)
    ops.rotary_range(1.2)
    got = ops.rotary(q, k, cos, sin)
    assert fake.kernel_calls == []
    assert all(torch.equal(a, b) for a, b in zip(got, PortableLayerOps().rotary(q, k, cos, sin)))
    assert sum("outside npu_rotary_mul's documented [-1, 1]" in r.getMessage() for r in caplog.records) == 1
