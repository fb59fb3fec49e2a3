"""Micro-benchmark of the LM's projections: `torch.mm` on the transposed row-major weights
(`DenseLinear`, what the CPU ran before) against the same weights prepacked for oneDNN at load
(`PrepackedLinear`, engine/lm/prepacked_linear.py), and MKL's own prepacked GEMM
(`mkl._mkl_reorder_linear_weight`, which inductor uses for fp32 at a fixed batch).

The small demo model's 32 projections (8 layers x QKV, O, gate-up, down; distinct random
weights, ~70 MB in fp32, so none stays cache-resident), one pass over all of them per sample, at
M = 1, 8 and 32 rows: median of --repeats passes with min, interleaved per M so drift hits each
kernel alike. fp32 (what `--dtype auto` runs on a CPU without native bf16); --dtype bfloat16
where oneDNN runs it (AVX512-BW/VL/DQ or AVX-NE-CONVERT).

    python benchmarks/prepacked_gemm.py [--repeats 15] [--dtype float32]
"""
from __future__ import annotations

import argparse
import statistics
import time

import torch

from epdserve.engine.lm.linear import DenseLinear
from epdserve.engine.lm.prepacked_linear import PrepackedLinear, usable
from epdserve.model.demo import PRESETS


def _projections(dtype: torch.dtype) -> list[tuple[torch.Tensor, torch.Tensor | None]]:
    s = PRESETS["small"]
    hd = s.hidden // s.heads
    gen = torch.Generator().manual_seed(0)
    shapes = [((s.heads + 2 * s.kv_heads) * hd, s.hidden, True), (s.hidden, s.heads * hd, False),
              (2 * s.intermediate, s.hidden, False), (s.hidden, s.intermediate, False)] * s.layers
    return [((torch.randn(o, i, generator=gen) * 0.02).to(dtype),
             (torch.randn(o, generator=gen) * 0.02).to(dtype) if bias else None) for o, i, bias in shapes]


class _Mkl:
    def __init__(self, w: torch.Tensor, b: torch.Tensor | None, rows: int):
        self.w, self.b, self.rows = w, b, rows
        self.packed = torch.ops.mkl._mkl_reorder_linear_weight(w, rows)

    def __call__(self, x):
        return torch.ops.mkl._mkl_linear(x, self.packed, self.w, self.b, self.rows)


def _time(kernels, xs, repeats: int) -> list[float]:
    for _ in range(3):
        for k, x in zip(kernels, xs):
            k(x)
    out = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        for k, x in zip(kernels, xs):
            k(x)
        out.append((time.perf_counter() - t0) * 1e3)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--repeats", type=int, default=15)
    ap.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32")
    args = ap.parse_args()
    dtype = getattr(torch, args.dtype)
    if not usable(dtype):
        raise SystemExit(f"oneDNN does not run {args.dtype} on this CPU")
    projs = _projections(dtype)
    print(f"| M | kernel | ms per pass (median) | min | ratio to torch.mm |\n|---:|---|---:|---:|---:|")
    for rows in (1, 8, 32):
        xs = [torch.randn(rows, w.shape[1]).to(dtype) for w, _ in projs]
        kinds = {"torch.mm (DenseLinear)": [DenseLinear([w], [b]) for w, b in projs],
                 "oneDNN prepacked (PrepackedLinear)": [PrepackedLinear([w], [b]) for w, b in projs]}
        if dtype == torch.float32:
            kinds["MKL prepacked (fixed M)"] = [_Mkl(w, b, rows) for w, b in projs]
        times = {name: _time(ks, xs, args.repeats) for name, ks in kinds.items()}
        base = statistics.median(times["torch.mm (DenseLinear)"])
        for name, ts in times.items():
            med = statistics.median(ts)
            print(f"| {rows} | {name} | {med:.2f} | {min(ts):.2f} | {med / base:.2f} |", flush=True)


if __name__ == "__main__":
    main()
