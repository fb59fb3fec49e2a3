"""NPU decode graphs: whether the installed torch_npu can capture them, and the capture itself
(`torch.npu.NPUGraph` under `torch.npu.graph`).

Every call below was read in torch_npu/npu/graphs.py and streams.py of the three wheels the
`[npu]` extras install (2.8.0 = Ascend/pytorch def4860, 2.9.0 = 12d689a, 2.12.0 = fa0f83f;
torch_npu/version.py git_version), where they are the same and exported from torch_npu.npu
(`__all__` of torch_npu/npu/__init__.py):
- `NPUGraph()` (a torch_npu._C._NPUGraph), `graph(npu_graph, pool=None, stream=None,
  auto_dispatch_capture=False, capture_error_mode="global")`: `__enter__` synchronizes, empties
  the cache and makes its capture stream (one per process, `default_capture_stream`) current,
  then `capture_begin(pool, capture_error_mode)`; `__exit__` runs `capture_end()` and restores
  the stream; `replay()`; `graph_pool_handle()`. We leave `auto_dispatch_capture` off: our own
  recorder (ops/npu_graph_fia.py) groups and re-issues the attention calls;
- `graph_task_group_begin(stream)`, `graph_task_group_end(stream) -> handle`,
  `graph_task_update_begin(stream, handle)`, `graph_task_update_end(stream)` and
  `ExternalEvent` (wait / reset / record with a stream): used by ops/npu_graph_fia.py.
A torch_npu without one of them decodes eagerly, and `graph_api_missing` says why (the engine's
graph report shows it); whether its operators have the FIA `.out` / max-workspace calls is the
ops' question (ops/npu_schema.py `graph_fia_missing`, `NpuPagedOps.graphs_unavailable_reason`). Nothing here has run on an NPU yet: the first run's graph step
(epdserve bench device) is what verifies it.
"""
from __future__ import annotations

from epdserve.platform.base import capture_body

GRAPH_API = ("NPUGraph", "graph", "graph_pool_handle", "ExternalEvent", "Stream", "graph_task_group_begin",
             "graph_task_group_end", "graph_task_update_begin", "graph_task_update_end")


def graph_api_missing(torch_npu) -> str | None:
    """Why this torch_npu cannot capture our decode graphs, in one line; None where it can."""
    absent = [name for name in GRAPH_API if not hasattr(torch_npu.npu, name)]
    if absent:
        version = getattr(torch_npu, "__version__", "?")
        return f"torch_npu {version} has no torch.npu.{', '.join(absent)} (NPU graphs with task updates)"
    return None


def capture_npu_graph(torch_npu, fn, pool):
    """(graph, fn's output): `fn`'s device work captured on torch.npu.graph's capture stream.
    capture_error_mode "thread_local": other threads' NPU calls (KV receivers, a co-located
    engine) do not break this capture. On a failure the thread's stream is set back (the
    context's `__exit__` runs `capture_end` before restoring it, and that may raise first) and
    the body's own error is raised."""
    npu = torch_npu.npu
    graph = npu.NPUGraph()
    before = npu.current_stream()
    out = capture_body(npu.graph(graph, pool=pool, capture_error_mode="thread_local"), fn,
                       lambda: npu.set_stream(before))
    return graph, out
