"""Operators per decode token at batch 1, counted with `torch.profiler` (`bench device` part perf).

Owns `ops_per_token`: two profiled greedy generates of one text request, `short` and `long` new
tokens; the difference of their counts over `long - short` tokens is what one decode step costs
(prefill and set-up cancel out). Counted: `device_kernels` (profiler events on the device: CUDA
kernels, memcpys and memsets; CUDA only, None elsewhere), `aten_ops` (host `aten::` operator
calls, nested ones included), `host_events` (every host-side profiler event, runtime calls such
as cudaLaunchKernel included: how the 2026-12-04 H200 probe counted its 6,445), and the launches
the host made (issue 52 item 5): `kernel_launches` (runtime and driver kernel launches:
cudaLaunchKernel, cudaLaunchKernelExC, cuLaunchKernel — Triton launches through the driver) and
`graph_launches` (cudaGraphLaunch): a replayed decode step is one graph launch and a few kernel
launches (sampling), an eager one a kernel launch per kernel. `attention_kernels` names the
device kernels of the longer run that attend (flash / memory-efficient SDPA, the Triton paged
decode kernel, ...): which backend SDPA chose, read off what ran.
"""
from __future__ import annotations

KERNEL_LAUNCHES = ("cudaLaunchKernel", "cuLaunchKernel")  # prefixes: ...ExC, ...Ex, _ptsz variants
GRAPH_LAUNCHES = ("cudaGraphLaunch", "cuGraphLaunch")
ATTENTION_WORDS = ("flash", "fmha", "attention", "attn", "efficient", "paged_decode", "sdpa")


def _counts(prof) -> dict[str, int]:
    device = aten = host = launches = graphs = 0
    for e in prof.key_averages():
        kind = getattr(e.device_type, "name", str(e.device_type))
        if kind == "CPU":
            host += e.count
            if e.key.startswith("aten::"):
                aten += e.count
            elif e.key.startswith(KERNEL_LAUNCHES):
                launches += e.count
            elif e.key.startswith(GRAPH_LAUNCHES):
                graphs += e.count
        else:
            device += e.count
    return {"device_kernels": device, "aten_ops": aten, "host_events": host, "kernel_launches": launches,
            "graph_launches": graphs}


def attention_kernels(prof) -> list[str]:
    """The device kernels that attend, by name (at most 100 characters each), sorted."""
    names = {e.key for e in prof.key_averages() if getattr(e.device_type, "name", str(e.device_type)) != "CPU"}
    return sorted(n[:100] for n in names if any(w in n.lower() for w in ATTENTION_WORDS))


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
        if n == long:
            attention = attention_kernels(prof)
            if table_path:
                with open(table_path, "w") as f:
                    f.write(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=40))
    steps = long - short
    out: dict = {k: round((counts[1][k] - counts[0][k]) / steps, 1) for k in counts[0]}
    if not cuda:
        out.update(device_kernels=None, kernel_launches=None, graph_launches=None)
    out["attention_kernels"] = attention if cuda else None
    return out
