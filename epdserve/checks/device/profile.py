"""Operators per decode token at batch 1, counted with `torch.profiler` (`bench device` part perf).

Owns `ops_per_token`: two profiled greedy generates of one text request, `short` and `long` new
tokens; the difference of their counts over `long - short` tokens is what one decode step costs
(prefill and set-up cancel out). Counted: `device_kernels` (profiler events on the device: CUDA
kernels, memcpys and memsets; CUDA only, None elsewhere), `aten_ops` (host `aten::` operator
calls, nested ones included) and `host_events` (every host-side profiler event, runtime calls such
as cudaLaunchKernel included: how the 2026-12-04 H200 probe counted its 6,445).
"""
from __future__ import annotations


def _counts(prof) -> dict[str, int]:
    device = aten = host = 0
    for e in prof.key_averages():
        kind = getattr(e.device_type, "name", str(e.device_type))
        if kind == "CPU":
            host += e.count
            if e.key.startswith("aten::"):
                aten += e.count
        else:
            device += e.count
    return {"device_kernels": device, "aten_ops": aten, "host_events": host}


def ops_per_token(generate, device: str, short: int = 9, long: int = 25, table_path: str | None = None) -> dict:
    """Per-token counts of `generate(n_tokens)` (a callable running one request to n tokens)."""
    from torch.profiler import ProfilerActivity, profile

    cuda = device.startswith("cuda")
    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    counts = []
    for n in (short, long):
        with profile(activities=acts) as prof:
            generate(n)
        counts.append(_counts(prof))
        if table_path and n == long:
            with open(table_path, "w") as f:
                f.write(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=40))
    steps = long - short
    out = {k: round((counts[1][k] - counts[0][k]) / steps, 1) for k in counts[0]}
    if not cuda:
        out["device_kernels"] = None
    return out
