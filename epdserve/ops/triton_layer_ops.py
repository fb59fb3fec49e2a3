"""`TritonLayerOps`: the `LayerOps` contract (ops/layer_ops.py) on CUDA as Triton kernels
(ops/triton_layer.py), one launch per call: add + RMSNorm, RMSNorm, rotary (q and k together, in
place), SiLU-and-mul. Equal to `PortableLayerOps` bit for bit but for RMSNorm's fp32 reduction
order (in bf16 / fp16 at most two units in the last place: one where `h.to(dtype)` rounds,
carried through `weight *`'s rounding; in fp32 a few ulps, N/2 + 4 at worst) and, where CUDA's
and the CPU's exp differ, SiLU (tests/ops/test_triton_layer.py derives the bounds).

Calls the kernels do not take go to the portable ops: a dtype other than fp32 / bf16 / fp16,
tensors of mixed dtypes, an odd head_dim, a weight that is not [N]. `check(shapes, device)` runs
each kernel once at start-up at the model's shapes (strided views of a fused QKV output, as the
LM forward passes them) and refuses to start, naming `EPDSERVE_OPS=portable`, when one fails to
build or disagrees with the portable op. Chosen by ops/select.py for CUDA when Triton imports.
"""
from __future__ import annotations

import torch

from epdserve.ops.layer_ops import LayerOps, LayerShapes, PortableLayerOps

_REL = {torch.bfloat16: 2.0 ** -6, torch.float16: 2.0 ** -9, torch.float32: 2.0 ** -12}  # the check's bound (loose:
# it catches a broken kernel; tests/ops/test_triton_layer.py holds the exact bounds)


class TritonLayerOps(LayerOps):
    """Stateless but for the kernel wrappers it holds (bound once, replaceable in tests)."""

    name = "triton"

    def __init__(self):
        from epdserve.ops import triton_layer  # Triton: imported only when chosen

        self._norm = triton_layer.rms_norm
        self._rotary = triton_layer.rotary
        self._silu_mul = triton_layer.silu_and_mul
        self._dtypes = triton_layer.DTYPES
        self._portable = PortableLayerOps()

    def add_rms_norm(self, x, residual, weight, eps):
        if not (self._norm_fits(x, weight) and (residual is None or (residual.dtype == x.dtype
                                                                     and residual.shape == x.shape))):
            return self._portable.add_rms_norm(x, residual, weight, eps)
        return self._norm(x, weight, eps, residual)

    def rms_norm(self, x, weight, eps):
        if not self._norm_fits(x, weight):
            return self._portable.rms_norm(x, weight, eps)
        return self._norm(x, weight, eps)[0]

    def rotary(self, q, k, cos, sin):
        d = q.shape[-1]
        if not (q.dim() == 3 and k.dim() == 3 and q.dtype in self._dtypes and k.dtype == cos.dtype == sin.dtype
                == q.dtype and d % 2 == 0 and k.shape[-1] == d and cos.shape == sin.shape == (q.shape[0], d)):
            return self._portable.rotary(q, k, cos, sin)
        q, k, cos, sin = (t if t.stride(-1) == 1 else t.contiguous() for t in (q, k, cos, sin))
        self._rotary(q, k, cos, sin)
        return q, k

    def silu_and_mul(self, x):
        if not (x.dtype in self._dtypes and x.shape[-1] % 2 == 0 and x.dim() >= 1):
            return self._portable.silu_and_mul(x)
        rows = x.reshape(-1, x.shape[-1])
        rows = rows if rows.stride(-1) == 1 else rows.contiguous()
        return self._silu_mul(rows).view(*x.shape[:-1], x.shape[-1] // 2)

    def _norm_fits(self, x, weight) -> bool:
        return (x.dim() >= 1 and x.dtype in self._dtypes and weight.dtype in self._dtypes and weight.dim() == 1
                and weight.shape[0] == x.shape[-1] and weight.stride(0) == 1)

    def check(self, shapes: LayerShapes, device) -> None:
        """Each kernel compiled and run once on `device` at `shapes`, against the portable op."""
        s, dt = shapes, shapes.dtype
        if dt not in _REL:  # no kernel takes it: every call goes to the portable ops
            return
        gen = torch.Generator().manual_seed(0)

        def rand(*shape, scale=1.0):
            return (torch.randn(*shape, generator=gen) * scale).to(device=device, dtype=dt)

        T, eps, ref = 3, 1e-6, self._portable
        x, res, w = rand(T, s.hidden), rand(T, s.hidden), rand(s.hidden).add(1)
        qkv = rand(T, (s.heads + 2 * s.kv_heads) * s.head_dim, scale=4)
        qw, kw = s.heads * s.head_dim, s.kv_heads * s.head_dim

        def views(buf):  # q and k as strided views of a fused QKV output, as the forward has them
            return buf[:, :qw].view(T, s.heads, s.head_dim), buf[:, qw: qw + kw].view(T, s.kv_heads, s.head_dim)

        q, k = views(qkv)
        hw = rand(s.head_dim).add(1)
        angle = torch.rand(T, s.head_dim // 2, generator=gen) * 6.3
        cos = torch.cat((angle.cos(), angle.cos()), -1).to(device=device, dtype=dt)
        sin = torch.cat((angle.sin(), angle.sin()), -1).to(device=device, dtype=dt)
        gate_up = rand(T, 2 * s.intermediate, scale=3)
        cases = (
            ("add + RMSNorm", lambda o: o.add_rms_norm(x.clone(), res.clone(), w, eps)),
            ("RMSNorm", lambda o: o.rms_norm(q, hw, eps)),
            ("rotary", lambda o: o.rotary(*views(qkv.clone()), cos, sin)),
            ("SiLU-and-mul", lambda o: o.silu_and_mul(gate_up)),
        )
        for what, call in cases:
            try:
                got = call(self)
            except Exception as e:
                raise ValueError(f"the Triton {what} kernel does not run here ({type(e).__name__}: {e}); set "
                                 f"EPDSERVE_OPS=portable") from e
            for g, r in zip(_tuple(got), _tuple(call(ref))):
                g, r = g.float(), r.float()
                if g.shape != r.shape or bool(((g - r).abs() > _REL[dt] * r.abs() + 1e-6).any()) or bool(
                        g.isnan().any()):
                    raise ValueError(f"the Triton {what} kernel's output differs from the portable op's on {device} "
                                     f"(largest error {float((g - r).abs().max()):.3g}); set EPDSERVE_OPS=portable")


def _tuple(x):
    return x if isinstance(x, tuple) else (x,)
