"""`epdserve build-ops`: build the native operators (csrc/: paged-KV attention and an LM layer's
fused element-wise ops) now, for this torch and this CPU.

Engines build them on first use anyway (torch's C++-extension JIT with ninja, cached per torch
version and source hash under $EPDSERVE_OPS_CACHE or ~/.cache/epdserve/ops); run this ahead of
time in a container image or CI to pay the ~30-60 s compile once, and to see the compiler's log
when a build fails. It checks the built operators against the portable ones before it returns.
`EPDSERVE_OPS=native|portable` then chooses at run time (unset: native when it builds).
"""
from __future__ import annotations

import logging

from epdserve.commands import add_command

log = logging.getLogger(__name__)


def add_parser(subparsers) -> None:
    p = add_command(subparsers, "build-ops", run, "build the native operators (csrc/) ahead of time", __doc__)
    p.add_argument("--quiet", action="store_true", help="do not print the compiler's commands")


def run(args) -> int:
    import torch

    from epdserve.ops.native import load_native_ops
    from epdserve.ops.native_build import build_and_load
    from epdserve.ops.portable import PortableOps

    folder = build_and_load(verbose=not args.quiet)
    native, portable = load_native_ops(), PortableOps()
    gen = torch.Generator().manual_seed(0)
    kc, vc = torch.randn(8, 16, 2, 64, generator=gen), torch.randn(8, 16, 2, 64, generator=gen)
    q, tables, ctx = torch.randn(2, 6, 64, generator=gen), torch.tensor([[3, 1, 6], [0, 7, 2]]), torch.tensor([40, 9])
    diff = (native.decode_attention(q, kc, vc, tables, ctx, 0.125)
            - portable.decode_attention(q, kc, vc, tables, ctx, 0.125)).abs().max().item()
    if diff > 1e-4:
        log.error("native decode attention differs from the portable one by %.3g", diff)
        return 1
    from epdserve.ops.layer_ops import PortableLayerOps
    from epdserve.ops.native_layer_ops import load_native_layer_ops

    layer, plain = load_native_layer_ops(), PortableLayerOps()
    x, res, w = torch.randn(3, 256, generator=gen), torch.randn(3, 256, generator=gen), torch.rand(256, generator=gen)
    gate_up = torch.randn(3, 512, generator=gen)
    for name, got, want in (
            ("add+RMSNorm", layer.add_rms_norm(x.clone(), res.clone(), w, 1e-6)[0],
             plain.add_rms_norm(x, res, w, 1e-6)[0]),
            ("SiLU-and-mul", layer.silu_and_mul(gate_up), plain.silu_and_mul(gate_up))):
        diff = (got - want).abs().max().item()
        if diff > 1e-5:
            log.error("native %s differs from the portable one by %.3g", name, diff)
            return 1
    print(f"native operators built and checked: {folder}")
    return 0
