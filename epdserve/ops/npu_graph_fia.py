"""`FiaGraphTasks`: the attention calls of one captured NPU decode graph, and the pass that
re-issues them with each step's lengths before its replay.

Why: npu_fused_infer_attention_score tiles on the host from its `actual_seq_lengths` /
`actual_seq_lengths_kv` lists (SymInt[]), at launch. A graph replays the launch it captured, so
its attention would attend the capture's lengths for ever. torch_npu lets a captured launch be
re-parameterised (torch_npu/npu/graphs.py `graph_task_group_begin` / `graph_task_group_end` ->
handle, `graph_task_update_begin(stream, handle)` / `graph_task_update_end(stream)`; the same on
v2.8.0-7.2.0, v2.9.0-7.3.0 and v2.12.0-26.1.0, read from the wheels), which is how torch_npu's own
`_GraphDispatchMode` (graphs.py `__torch_dispatch__`, `update_capture_record`) and vllm-ascend
(vllm_ascend/attention/attention_v1.py `full_graph_fia` at capture, `update_graph_params` before
each replay; main 182b75e) do it. Per layer, at capture (`capture`), on the capturing stream:
- a workspace from `torch_npu._npu_fused_infer_attention_score_get_max_workspace(...)` (op-plugin
  op_plugin/ops/opapi/FusedInferAttentionScoreKernelNpuOpApi.cpp
  `_npu_fused_infer_attention_score_get_max_workspace_symint`: aclnnFusedInferAttentionScoreV3
  GetMaxWorkspaceSize; branches 7.2.0 738effc, 7.3.0 b3065ed, 26.1.0 09024aa), asked once per
  graph with the bucket's widest lengths and shared by its layers (their calls have one shape and
  run one after another on the stream, as vllm-ascend shares one per captured size), kept static
  with each layer's output (`attention_out`) and `softmax_lse` [1];
- a `torch.npu.ExternalEvent` waited on and reset in the graph (streams.py `ExternalEvent`: "you
  can call wait() before record()"), so each replay's attention waits for its update;
- `torch_npu.npu_fused_infer_attention_score.out(..., workspace=, attention_out=, softmax_lse=)`
  between `graph_task_group_begin(stream)` and `graph_task_group_end(stream)` (the .out schema,
  the same on the three lines: tests/fixtures/torch_npu/<line>.txt; with a workspace it goes
  through EXEC_UPDATE_NPU_NO_FORMAT_CHECK_CMD, the path an update can re-issue). The out tensors
  are passed by their schema names, which torch's createStackForSchema binds by name on any torch;
  vllm-ascend passes `out=[...]`, which torch 2.13's binder refused for an op of this schema here
  (how it binds on the device was not seen). Where a line registers other names, the start-up
  schema check (ops/npu_schema.py `graph_fia_missing`) keeps graphs off, saying so.
Before a replay (`update`), on a side stream of our own (as graphs.py `update_capture_record` and
vllm-ascend use one): per layer, `graph_task_update_begin(stream, handle)`, the same .out call
with the step's lengths (padding rows attend their one padding-block token: KV length 1), then
`graph_task_update_end(stream)` and `event.record(stream)`. The engine reads every step's sampled
tokens back before the next step, so no update rewrites a task a replay is still running.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class _Site:
    """One layer's captured attention launch."""

    handle: object  # the task group's handle (torch_npu._C._NPUTaskGroupHandle)
    event: object  # its ExternalEvent
    args: tuple  # (query, key, value) as captured
    kwargs: dict  # the rest of the call, lengths included (replaced per update)


class FiaGraphTasks:
    """The FIA launches of one graph (one per layer, in capture order)."""

    def __init__(self, torch_npu, update_stream):
        self._npu = torch_npu
        self._stream = update_stream
        self.sites: list[_Site] = []
        self.workspace: torch.Tensor | None = None

    def capture(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, kwargs: dict,
                widest_kv: int) -> torch.Tensor:
        """Launch one layer's attention inside a task group on the capturing stream; the static
        output. `kwargs`: the eager call's keywords (capture-time lengths); `widest_kv`: the KV
        length the workspace must hold for every row (the bucket's width in tokens)."""
        npu = self._npu
        stream = npu.npu.current_stream()
        if self.workspace is None:  # one for the graph: its layers' calls have one shape and run in turn
            widest = dict(kwargs, actual_seq_lengths_kv=[widest_kv] * len(kwargs["actual_seq_lengths_kv"]))
            self.workspace = npu._npu_fused_infer_attention_score_get_max_workspace(query, key, value, **widest)
        workspace = self.workspace
        out = torch.empty_like(query)
        lse = torch.empty(1, dtype=query.dtype, device=query.device)
        event = npu.npu.ExternalEvent()
        event.wait(stream)
        event.reset(stream)
        call = dict(kwargs, workspace=workspace, attention_out=out, softmax_lse=lse)
        npu.npu.graph_task_group_begin(stream)
        npu.npu_fused_infer_attention_score.out(query, key, value, **call)
        handle = npu.npu.graph_task_group_end(stream)
        self.sites.append(_Site(handle, event, (query, key, value), call))
        return out

    def update(self, q_ends: list[int], kv_lens: list[int]) -> None:
        """Re-issue every captured attention with this step's lengths (padding rows included)."""
        npu = self._npu
        with npu.npu.stream(self._stream):
            for site in self.sites:
                site.kwargs["actual_seq_lengths"] = list(q_ends)
                site.kwargs["actual_seq_lengths_kv"] = list(kv_lens)
                npu.npu.graph_task_update_begin(self._stream, site.handle)
                npu.npu_fused_infer_attention_score.out(*site.args, **site.kwargs)
                npu.npu.graph_task_update_end(self._stream)
                site.event.record(self._stream)
