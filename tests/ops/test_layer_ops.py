"""The native LM-layer operators (csrc/cpu/layer_ops.cpp, `NativeLayerOps`) against the portable
torch ones (`PortableLayerOps`, transformers' arithmetic), `torch.library.opcheck`, and how many
operators each dispatches (the issue-36 bound of 25 aten operators per LM layer per decode step).

Equal, or how close, and why:
- the residual sum and the rotary: bit-equal in every dtype (each op rounds to the dtype as
  torch's does; a product of two bf16 is exact in fp32);
- RMSNorm (with and without the residual): bit-equal on x86 in fp32 and bf16: the kernel adds the
  squares in the order of torch's sum (its cascade over 8-float vectors); elsewhere (another
  vector width) fp32 within 1e-5 and bf16 within one ulp, as the variance's last bit may differ;
- silu-and-mul: fp32 within 1e-5 and bf16 / fp16 within one ulp. It is bit-equal wherever the
  library and torch use the same exp (Sleef's, in AVX2 / AVX512 builds: this CPU's), but torch
  computes the elements past its vectorized loop's last full step (and around its parallel
  chunks' edges) with std::exp, and a build without AVX2 takes std::exp throughout.
Not covered by the bit-equality: a tensor whose last dim is not contiguous (torch then sums in
its outer-reduction order), and a single row longer than 32768 elements (torch splits that sum
over its threads, in an order that depends on the thread count).
"""
import os
import platform
import subprocess
import sys
import types

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from epdserve.engine.config import EngineConfig
from epdserve.ops.layer_ops import PortableLayerOps
from epdserve.ops.native_layer_ops import NativeLayerOps, load_native_layer_ops
from epdserve.ops.select import NativeOpsUnavailable, layer_ops
from epdserve.platform import get_platform
from epdserve.platform.cuda import CudaPlatform

NATIVE = load_native_layer_ops()
PORTABLE = PortableLayerOps()
DTYPES = [torch.float32, torch.bfloat16]
TOKENS = [1, 7, 64]
EPS = 1e-6
MANTISSA_BITS = {torch.bfloat16: 7, torch.float16: 10}
NORM_EXACT = platform.machine().lower() in ("x86_64", "amd64")  # torch sums in 8-float vectors there


def _close(got, want, dtype, exact=False):
    assert got.dtype == want.dtype == dtype and got.shape == want.shape
    if exact:
        assert torch.equal(got, want), f"{(got != want).sum().item()} of {got.numel()} elements differ"
    elif dtype == torch.float32:
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    else:  # within one ulp of the dtype: |got - want| <= 2^(exponent of want - mantissa bits)
        g, w = got.float(), want.float()
        _, e = torch.frexp(w)  # |w| in [2^(e-1), 2^e)
        ulp = torch.ldexp(torch.ones_like(w), e - 1 - MANTISSA_BITS[dtype])
        ulp = torch.where(w == 0, torch.finfo(dtype).smallest_normal, ulp)
        bad = (g - w).abs() > ulp
        assert not bad.any(), f"{bad.sum().item()} elements more than one ulp apart, e.g. {g[bad][:4]} vs {w[bad][:4]}"


def _gen(seed):
    return torch.Generator().manual_seed(seed)


def _weight(d, dtype, gen):
    return (torch.rand(d, generator=gen) + 0.5).to(dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("tokens", TOKENS)
@pytest.mark.parametrize("hidden", [5, 64, 100, 512, 1536, 8192])
def test_add_rms_norm_matches_portable(dtype, tokens, hidden):
    gen = _gen(tokens * 10_000 + hidden)
    x = (torch.randn(tokens, hidden, generator=gen) * 3).to(dtype)
    res = torch.randn(tokens, hidden, generator=gen).to(dtype)
    w = _weight(hidden, dtype, gen)
    want_n, want_s = PORTABLE.add_rms_norm(x.clone(), res.clone(), w, EPS)
    got_n, got_s = NATIVE.add_rms_norm(x.clone(), res.clone(), w, EPS)
    _close(got_s, want_s, dtype, exact=True)  # one rounded add: nothing to differ
    _close(got_n, want_n, dtype, exact=NORM_EXACT)
    # no residual yet: the sum is x itself
    want_n, want_s = PORTABLE.add_rms_norm(x.clone(), None, w, EPS)
    got_n, got_s = NATIVE.add_rms_norm(x.clone(), None, w, EPS)
    _close(got_s, want_s, dtype, exact=True)
    _close(got_n, want_n, dtype, exact=NORM_EXACT)


def test_add_rms_norm_writes_in_place_and_big_hidden():
    gen = _gen(3)
    x, res = torch.randn(2, 8192, generator=gen), torch.randn(2, 8192, generator=gen)
    w = _weight(8192, torch.float32, gen)
    xc, rc = x.clone(), res.clone()
    got_n, got_s = NATIVE.add_rms_norm(xc, rc, w, EPS)
    assert got_n.data_ptr() == xc.data_ptr() and got_s.data_ptr() == rc.data_ptr()
    want_n, want_s = PORTABLE.add_rms_norm(x, res, w, EPS)
    _close(got_s, want_s, torch.float32, exact=True)
    _close(got_n, want_n, torch.float32, exact=NORM_EXACT)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("tokens", TOKENS)
def test_rms_norm_matches_portable_and_qwen3_head_norm(dtype, tokens):
    gen = _gen(tokens)
    x = torch.randn(tokens, 768, generator=gen).to(dtype)
    w = _weight(768, dtype, gen)
    _close(NATIVE.rms_norm(x, w, EPS), PORTABLE.rms_norm(x, w, EPS), dtype, exact=NORM_EXACT)
    # Qwen3's per-head q/k norms: [T, H, head_dim] views into a fused QKV output (token-strided)
    heads, kvh, hd = 8, 2, 128
    qkv = torch.randn(tokens, (heads + 2 * kvh) * hd, generator=gen).to(dtype)
    q = qkv[:, : heads * hd].view(tokens, heads, hd)
    k = qkv[:, heads * hd: (heads + kvh) * hd].view(tokens, kvh, hd)
    qw, kw = _weight(hd, dtype, gen), _weight(hd, dtype, gen)
    for t, tw in ((q, qw), (k, kw)):
        got = NATIVE.rms_norm(t, tw, EPS)
        _close(got, PORTABLE.rms_norm(t, tw, EPS), dtype, exact=NORM_EXACT)
        assert got.is_contiguous()
    # any other layout: a 1-D row, a transposed (non-contiguous last dim) tensor
    _close(NATIVE.rms_norm(x[0], w, EPS), PORTABLE.rms_norm(x[0], w, EPS), dtype, exact=NORM_EXACT)
    xt = torch.randn(768, tokens, generator=gen).to(dtype).t()
    # (torch sums a column-major tensor's rows in another order, its outer reduction: not bit-equal)
    _close(NATIVE.rms_norm(xt, w, EPS), PORTABLE.rms_norm(xt, w, EPS), dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("tokens", TOKENS)
@pytest.mark.parametrize("heads,kvh,hd", [(8, 2, 64), (12, 2, 128), (4, 4, 40)])
def test_rotary_matches_portable_on_fused_qkv_views(dtype, tokens, heads, kvh, hd):
    gen = _gen(tokens * 1000 + hd)
    qkv = torch.randn(tokens, (heads + 2 * kvh) * hd, generator=gen).to(dtype)
    pos = torch.arange(tokens, dtype=torch.float32)[:, None] * 0.37
    inv = 1.0 / (10000 ** (torch.arange(0, hd, 2, dtype=torch.float32) / hd))
    ang = torch.cat((pos * inv, pos * inv), dim=-1)  # both halves repeat the frequencies
    cos, sin = ang.cos().to(dtype), ang.sin().to(dtype)

    def views(t):
        return (t[:, : heads * hd].view(tokens, heads, hd),
                t[:, heads * hd: (heads + kvh) * hd].view(tokens, kvh, hd))

    want_q, want_k = PORTABLE.rotary(*views(qkv), cos, sin)
    mine = qkv.clone()
    got_q, got_k = NATIVE.rotary(*views(mine), cos, sin)
    _close(got_q, want_q, dtype, exact=True)  # products of two bf16 are exact in fp32, each op rounded as torch
    _close(got_k, want_k, dtype, exact=True)
    assert torch.equal(mine[:, (heads + kvh) * hd:], qkv[:, (heads + kvh) * hd:])  # v untouched
    assert torch.equal(views(mine)[0], got_q)  # rotated where it lies
    # cos / sin as token-strided views too (one [T, 2d] table)
    table = torch.cat((cos, sin), dim=-1)
    again = qkv.clone()
    got_q, got_k = NATIVE.rotary(*views(again), table[:, :hd], table[:, hd:])
    _close(got_q, want_q, dtype, exact=True)
    _close(got_k, want_k, dtype, exact=True)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("tokens", TOKENS)
@pytest.mark.parametrize("inter", [64, 100, 3584])
def test_silu_and_mul_matches_portable(dtype, tokens, inter):
    gen = _gen(tokens * 7 + inter)
    x = (torch.randn(tokens, 2 * inter, generator=gen) * 4).to(dtype)
    _close(NATIVE.silu_and_mul(x), PORTABLE.silu_and_mul(x), dtype)


@pytest.mark.parametrize("dtype", DTYPES)
def test_denormals_infinities_and_nans_round_as_torch(dtype):
    """silu of -88..-100 is a denormal float (torch keeps it, rounded; a converter that reads
    denormals as zero would not); inf and NaN pass through as torch passes them."""
    gate = torch.linspace(-100, -85, 64).to(dtype)
    gate[:3] = torch.tensor([float("inf"), float("-inf"), float("nan")])
    x = torch.cat((gate, torch.full((64,), 3.0).to(dtype)))[None]
    got, want = NATIVE.silu_and_mul(x), PORTABLE.silu_and_mul(x)
    assert torch.equal(got.isnan(), want.isnan())
    ok = ~want.isnan()
    if dtype == torch.float32:  # its exp may be another's (module docstring): denormals a few ulps apart
        torch.testing.assert_close(got[ok], want[ok], atol=1e-40, rtol=1e-5)
    else:
        assert torch.equal(got[ok], want[ok]), (got[ok], want[ok])
    assert (want[ok] != 0).sum() > 10  # the denormal outputs were there to get wrong
    tiny = torch.full((2, 32), 1e-39).to(dtype)  # denormal inputs of the residual add and the norm
    got_n, got_s = NATIVE.add_rms_norm(tiny.clone(), tiny.clone(), torch.ones(32, dtype=dtype), 0.0)
    want_n, want_s = PORTABLE.add_rms_norm(tiny.clone(), tiny.clone(), torch.ones(32, dtype=dtype), 0.0)
    assert torch.equal(got_s, want_s) and torch.equal(got_n, want_n)


@pytest.mark.parametrize("dtype", DTYPES)
def test_prefill_shapes_split_over_threads(dtype):
    """T = 4096: every operator splits its tokens over the threads (at::parallel_for)."""
    gen = _gen(17)
    tokens, hidden, heads, kvh, hd, inter = 4096, 1024, 8, 2, 128, 2048
    x, res = torch.randn(tokens, hidden, generator=gen).to(dtype), torch.randn(tokens, hidden, generator=gen).to(dtype)
    w = _weight(hidden, dtype, gen)
    want_n, want_s = PORTABLE.add_rms_norm(x.clone(), res.clone(), w, EPS)
    got_n, got_s = NATIVE.add_rms_norm(x.clone(), res.clone(), w, EPS)
    _close(got_s, want_s, dtype, exact=True)
    _close(got_n, want_n, dtype, exact=NORM_EXACT)
    qkv = torch.randn(tokens, (heads + 2 * kvh) * hd, generator=gen).to(dtype)
    ang = torch.rand(tokens, hd // 2, generator=gen) * 100
    cos, sin = torch.cat((ang, ang), -1).cos().to(dtype), torch.cat((ang, ang), -1).sin().to(dtype)
    q, k = qkv[:, : heads * hd].view(tokens, heads, hd), qkv[:, heads * hd: (heads + kvh) * hd].view(tokens, kvh, hd)
    want_q, want_k = PORTABLE.rotary(q, k, cos, sin)
    got_q, got_k = NATIVE.rotary(q.clone(), k.clone(), cos, sin)
    _close(got_q, want_q, dtype, exact=True)
    _close(got_k, want_k, dtype, exact=True)
    gu = (torch.randn(tokens, 2 * inter, generator=gen) * 4).to(dtype)
    _close(NATIVE.silu_and_mul(gu), PORTABLE.silu_and_mul(gu), dtype)


def test_fp16_and_empty_batches():
    gen = _gen(11)
    x, res = torch.randn(5, 96, generator=gen).half(), torch.randn(5, 96, generator=gen).half()
    w = _weight(96, torch.float16, gen)
    _close(NATIVE.add_rms_norm(x.clone(), res.clone(), w, EPS)[0], PORTABLE.add_rms_norm(x, res, w, EPS)[0],
           torch.float16)
    g = torch.randn(5, 192, generator=gen).half()
    _close(NATIVE.silu_and_mul(g), PORTABLE.silu_and_mul(g), torch.float16)
    e = torch.zeros(0, 64)
    assert NATIVE.rms_norm(e, torch.ones(64), EPS).shape == (0, 64)
    assert NATIVE.silu_and_mul(torch.zeros(0, 128)).shape == (0, 64)
    n, s = NATIVE.add_rms_norm(e.clone(), e.clone(), torch.ones(64), EPS)
    assert n.shape == s.shape == (0, 64)
    q, k = NATIVE.rotary(torch.zeros(0, 4, 32), torch.zeros(0, 2, 32), torch.zeros(0, 32), torch.zeros(0, 32))
    assert q.shape == (0, 4, 32) and k.shape == (0, 2, 32)


def test_bad_inputs_raise():
    x = torch.randn(3, 64)
    with pytest.raises(RuntimeError, match="weight dtype"):
        NATIVE.rms_norm(x, torch.ones(64, dtype=torch.bfloat16), EPS)
    with pytest.raises(RuntimeError, match="weight must be"):
        NATIVE.rms_norm(x, torch.ones(32), EPS)
    with pytest.raises(RuntimeError, match="float32, bfloat16 or float16"):
        NATIVE.silu_and_mul(x.double())
    with pytest.raises(RuntimeError, match="in place"):
        NATIVE.add_rms_norm(torch.randn(64, 3).t(), torch.randn(3, 64), torch.ones(64), EPS)
    with pytest.raises(RuntimeError, match="even"):
        NATIVE.rotary(torch.randn(2, 2, 5), torch.randn(2, 1, 5), torch.randn(2, 5), torch.randn(2, 5))
    with pytest.raises(RuntimeError, match="share one dtype"):
        NATIVE.rotary(torch.randn(2, 2, 8), torch.randn(2, 1, 8), torch.randn(2, 8).bfloat16(), torch.randn(2, 8))


@pytest.mark.parametrize("dtype", DTYPES)
def test_opcheck_every_operator(dtype):
    gen = _gen(5)
    x, res = torch.randn(3, 64, generator=gen).to(dtype), torch.randn(3, 64, generator=gen).to(dtype)
    w = _weight(64, dtype, gen)
    torch.library.opcheck(torch.ops.epdserve.fused_add_rms_norm.default, (x, res, w, EPS))
    torch.library.opcheck(torch.ops.epdserve.rms_norm.default, (x, w, EPS))
    torch.library.opcheck(torch.ops.epdserve.rms_norm.default, (torch.randn(3, 4, 64).to(dtype), w, EPS))
    qkv = torch.randn(3, 8 * 32, generator=gen).to(dtype)
    q, k = qkv[:, : 4 * 32].view(3, 4, 32), qkv[:, 4 * 32: 6 * 32].view(3, 2, 32)
    cos, sin = torch.randn(3, 32, generator=gen).to(dtype), torch.randn(3, 32, generator=gen).to(dtype)
    torch.library.opcheck(torch.ops.epdserve.rotary_embedding.default, (q, k, cos, sin))
    torch.library.opcheck(torch.ops.epdserve.silu_and_mul.default, (torch.randn(3, 128, generator=gen).to(dtype),))


class _CountOps(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.ops = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops.append(str(func))
        return func(*args, **(kwargs or {}))


def _count(fn, *args):
    with _CountOps() as mode:
        fn(*args)
    return mode.ops


def test_each_native_call_dispatches_one_operator():
    """A decode step of one lean layer calls add_rms_norm twice, rotary and silu_and_mul once:
    natively 4 operators between the matmuls and the attention, where the portable forms take
    dozens (the issue's count: 68 per layer today, aim <= 25)."""
    hidden, heads, kvh, hd, inter = 512, 8, 2, 64, 1024
    x, res, w = torch.randn(4, hidden), torch.randn(4, hidden), torch.rand(hidden)
    qkv = torch.randn(4, (heads + 2 * kvh) * hd)
    q, k = qkv[:, : heads * hd].view(4, heads, hd), qkv[:, heads * hd: (heads + kvh) * hd].view(4, kvh, hd)
    cos, sin = torch.randn(4, hd), torch.randn(4, hd)
    gu, hw = torch.randn(4, 2 * inter), torch.rand(hd)
    calls = {
        "add_rms_norm": (lambda o: o.add_rms_norm(x.clone(), res.clone(), w, EPS)),
        "rms_norm": (lambda o: o.rms_norm(q, hw, EPS)),
        "rotary": (lambda o: o.rotary(q, k, cos, sin)),
        "silu_and_mul": (lambda o: o.silu_and_mul(gu)),
    }
    portable_total = 0
    for name, call in calls.items():
        x_c, res_c = x.clone(), res.clone()  # clones made outside the counted region
        fn = (lambda o: o.add_rms_norm(x_c, res_c, w, EPS)) if name == "add_rms_norm" else call
        native_ops = _count(fn, NATIVE)
        assert len(native_ops) == 1 and native_ops[0].startswith("epdserve."), (name, native_ops)
        portable_ops = _count(call, PORTABLE)
        assert len(portable_ops) >= 3, (name, portable_ops)
        portable_total += len(portable_ops)
    assert portable_total >= 20  # what the native operators save per layer (rms_norm: 5, rotary: ~14, ...)


def test_layer_ops_selection(monkeypatch):
    cpu = get_platform("cpu")
    monkeypatch.delenv("EPDSERVE_OPS", raising=False)
    assert isinstance(layer_ops(cpu), NativeLayerOps)
    assert layer_ops(cpu, "native").name == "native"
    assert layer_ops(cpu, "portable").name == "portable"
    monkeypatch.setenv("EPDSERVE_OPS", "portable")  # the engine's `ops` setting, when not given
    assert layer_ops(cpu, EngineConfig(model="unused").ops).name == "portable"
    with pytest.raises(ValueError, match="native, portable"):
        layer_ops(cpu, "fast")
    monkeypatch.delenv("EPDSERVE_OPS")
    assert layer_ops(CudaPlatform()).name == "triton"  # TritonLayerOps (tests/ops/test_triton_layer.py)
    with pytest.raises(NativeOpsUnavailable, match="CPU kernels only"):
        layer_ops(CudaPlatform(), "native")


def test_layer_ops_on_npu(monkeypatch):
    class Npu:  # the selection only reads the platform's name: no torch_npu needed
        name = "npu"

    monkeypatch.delenv("EPDSERVE_OPS", raising=False)
    fake = types.ModuleType("epdserve.ops.npu_layer_ops")
    fake.NpuLayerOps = type("NpuLayerOps", (PortableLayerOps,), {"name": "npu"})
    monkeypatch.setitem(sys.modules, "epdserve.ops.npu_layer_ops", fake)
    assert layer_ops(Npu()).name == "npu"
    assert layer_ops(Npu(), "portable").name == "portable"
    with pytest.raises(NativeOpsUnavailable, match="no native layer operators for npu"):
        layer_ops(Npu(), "native")


PROBE = """
import logging
logging.basicConfig(level=logging.WARNING)
from epdserve.engine.config import EngineConfig
from epdserve.ops.select import layer_ops
from epdserve.platform import get_platform
try:
    choice = EngineConfig(model="unused").ops  # $EPDSERVE_OPS, as an engine reads it
    print("ops:", layer_ops(get_platform("cpu"), choice).name, layer_ops(get_platform("cpu"), choice).name)
except Exception as e:
    print("raised:", type(e).__name__, e)
"""


def test_failed_build_falls_back_once_or_fails_under_ci(tmp_path):
    """A real failed build: a subprocess whose PATH has no ninja and whose build cache is empty."""
    base = {k: v for k, v in os.environ.items() if k not in ("CI", "EPDSERVE_OPS")}
    base.update(PATH=str(tmp_path), EPDSERVE_OPS_CACHE=str(tmp_path / "cache"))

    def probe(**env):
        r = subprocess.run([sys.executable, "-c", PROBE], env={**base, **env}, capture_output=True, text=True,
                           timeout=120)
        return r.stdout, r.stderr

    out, err = probe()
    assert "ops: portable portable" in out
    assert err.count("native layer operators unavailable (") == 1  # once, with the reason
    out, _ = probe(CI="true")
    assert "raised: NativeOpsUnavailable" in out
