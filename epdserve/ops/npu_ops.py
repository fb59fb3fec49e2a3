"""`NpuPagedOps`: the paged-KV operators on Ascend NPUs, over torch_npu's built-in kernels.

Only this module and platform/npu.py import torch_npu, lazily, inside methods. The calls follow
how vllm-ascend's attention backend makes them; every signature below was read from source:

- KV write, chosen once, at construction, by the installed operators' schemas
  (ops/npu_schema.py `probe_npu_kernels`; the schema of each line the extras install is in
  tests/fixtures/torch_npu/<version>.txt, extracted from the PyPI wheels):
  * torch_npu 2.12.0 (op-plugin 26.1.0): `torch_npu.npu_scatter_pa_kv_cache(key, value,
    key_cache, value_cache, slot_mapping, *, compress_lens=None, compress_seq_offsets=None,
    seq_lens=None, cache_mode='PA_NZ') -> ()` (Ascend/op-plugin 26.1.0
    op_plugin/config/op_plugin_functions.yaml; op_plugin/ops/opapi/ScatterPaKvCacheNpuOpApi.cpp
    `npu_scatter_pa_kv_cache` passes cache_mode to aclnnScatterPaKvCache). The default 'PA_NZ'
    expects the NZ layout [num_blocks, H*D/16, block_size, 16]; our ND layout needs
    cache_mode="Norm", as vllm-ascend vllm_ascend/device/device_op.py
    BaseDeviceAdaptor.reshape_and_cache passes. key/value fp16/bf16/int8 (no fp32 on A2/A3),
    contiguous; slot_mapping int32 or int64 (we pass int32 as vllm_ascend/attention/
    attention_v1.py does). An Ascend C (AI Core) operator (hicann/ops-transformer
    attention/scatter_pa_kv_cache/op_host/scatter_pa_kv_cache_def.cpp), so it should stay within
    a stream's core limit (not measured: no NPU here);
  * torch_npu 2.8.0 (op-plugin 7.2.0) and 2.9.0 (op-plugin 7.3.0): npu_scatter_pa_kv_cache has no
    cache_mode (op_plugin_functions.yaml on both branches; ScatterPaKvCacheNpuOpApi.cpp
    `npu_scatter_pa_kv_cache` hard-codes `cache_mode = "PA_NZ"`), so it cannot write our layout.
    These lines use the ATB `torch_npu._npu_reshape_and_cache(key, value, key_cache,
    value_cache, slot_indices) -> ()` (op_plugin/ops/atb/ReshapeAndCachAtb.cpp
    `_npu_reshape_and_cache`, the same on 7.2.0, 7.3.0 and 26.1.0; ND layout, int32 slots as in
    test/test_custom_ops/test_atb_reshape_and_cache.py). An ATB operator: it IGNORES stream
    core limits, so a co-located stage calling it is not confined to its share (logged once).
  Where neither fits (an old line without NNAL's libop_plugin_atb.so), construction raises
  `NpuKernelsUnsupported`, before the first KV write.
- `torch_npu.npu_fused_infer_attention_score(query, key, value, *, ..., atten_mask=None,
  actual_seq_lengths=None, actual_seq_lengths_kv=None, block_table=None, num_heads=1, scale=1.0,
  input_layout="BSH", num_key_value_heads=0, sparse_mode=0, block_size=0, ...) -> (out, lse)`
  (op_plugin_functions.yaml; docs/zh/custom_APIs/torch_npu/
  torch_npu-npu_fused_infer_attention_score.md). An Ascend C operator (ops-transformer
  attention/fused_infer_attention_score), so it should honour stream core limits (not measured).
  query bf16 only in the TND layout with a block table (PFA's tiling refuses fp16 there, and
  head_dim other than 64 / 128 / 192: ops/npu_attention_check.py, which also runs one tiny call
  at start-up because vllm-ascend issues #4373 / #8045 report CANN 8.3.RC1 refusing TND + paged).
  With a block table ("PageAttention"): key/value are the caches viewed [num_blocks, block_size,
  kv_heads * head_dim] ("BnBsH", as vllm-ascend `_get_fia_params` views them), block_table int32
  [B, >= blocks needed], actual_seq_lengths_kv a list of per-request lengths (required).
  One call per layer per step, for every request of the step (decodes, prompt chunks, fresh
  prompts, whose K/V the step has just written), as vllm-ascend makes it
  (vllm_ascend/attention/attention_v1.py AscendAttentionBackendImpl.forward_fused_infer_attention,
  the causal branch; forward_impl takes it for every state unless a decode-only paged-attention
  graph shape is configured): input_layout "TND", query [T, heads, D];
  actual_seq_lengths the CUMULATIVE query lengths (AscendAttentionMetadataBuilder.build:
  `query_start_loc_cpu[1:].tolist()`; the doc: "when input_layout of query is TND this parameter
  is required, its element count is the batch size, each element is the sum of the sequence
  lengths of this batch and all previous ones" — docs/context/
  torch_npu-npu_fused_infer_attention_score.md on op-plugin 7.2.0 and 7.3.0, docs/en/custom_APIs/
  torch_npu/torch_npu-npu_fused_infer_attention_score.md on 26.0.0 / 26.1.0);
  actual_seq_lengths_kv per request, not cumulative (`seq_lens_list`, as _get_fia_params passes
  it with a block table); sparse_mode=3 ("rightDownCausal": query i of a request sees its keys
  j <= kv_len - q_len + i, so a one-token decode sees all) with the 2048x2048 int8 mask
  triu(ones, 1) (1 = masked) of vllm_ascend/attention/attention_mask.py
  AttentionMaskBuilder.get_splitfuse_attn_mask. The schema these arguments come from is the same
  on op-plugin 7.2.0, 7.3.0, 26.0.0 and 26.1.0 (op_plugin_functions.yaml,
  `npu_fused_infer_attention_score(...)`). The doc's D = 128 rule for TND sits under the MLA
  (query_rope/key_rope) constraints; not measured here (no NPU).
  The lengths are host ints (SymInt[]), built once per step (ops/attention_meta.py): no call
  reads a device tensor back. In a decode graph's capture (`VarlenBatch.graph_tasks` set) the
  call is the re-issuable `.out` one of ops/npu_graph_fia.py instead, re-parameterised with each
  step's lengths before the replay; the KV write is captured as it is (its slots are a device
  tensor: nothing of the step is on the host), as vllm-ascend's full decode graphs capture theirs
  inside the forward: the ATB `_npu_reshape_and_cache` on releases/v0.13.0 (f92eadf,
  attention_v1.py `reshape_and_cache`, the torch_npu 2.8.0 line), `npu_scatter_pa_kv_cache(...,
  cache_mode="Norm")` on main (182b75e, device/device_op.py BaseDeviceAdaptor.reshape_and_cache).

Block size: with a block table the documented rule is block_size in (0, 512] when each query has
one token, a multiple of 128 in [128, 512] when it has more (prefill chunks; newer CANN relaxes
this for head_dim 64/128, ops-transformer op_host/checkers/paged_attention_checker.cpp); vllm-ascend
supports only 128 (AscendAttentionBackend.get_supported_kernel_block_sizes), hence
`NpuPlatform.kv_block_size = 128`. Cache layout is the engine's own, per layer
[num_blocks, block_size, kv_heads, head_dim], contiguous.
"""
from __future__ import annotations

import logging

import torch

from epdserve.ops.attention_meta import VarlenBatch
from epdserve.ops.backend import PagedOps
from epdserve.ops.npu_schema import ATB_ND, SCATTER_ND, graph_fia_missing, probe_npu_kernels

log = logging.getLogger(__name__)

_KERNEL_DTYPES = (torch.float16, torch.bfloat16)  # the KV writes
_ATTENTION_DTYPES = (torch.bfloat16,)  # FIA TND + paged: PFA's tiling, "inputDataType should be bf16"
_CAUSAL_MASK_SIZE = 2048  # sparse_mode 2/3/4 take this fixed "optimized" mask


class NpuPagedOps(PagedOps):
    name = "npu"
    index_dtype = torch.int32  # block_table must be int32; slots int32 as vllm-ascend passes them
    attends_varlen = True

    def __init__(self):
        import torch_npu  # registers the npu:: and atb:: operators probed below

        self._npu = torch_npu
        self._kernels = probe_npu_kernels(torch_npu)  # once: the calls this torch_npu's schemas allow
        self._masks: dict[torch.device, torch.Tensor] = {}
        self._update_stream = None  # the decode graphs' task-update stream (`graph_tasks`)
        if self._kernels.kv_write == ATB_ND:
            log.warning("torch_npu %s's npu_scatter_pa_kv_cache cannot write the ND cache (no cache_mode before "
                        "op-plugin 26.0): KV writes use the ATB _npu_reshape_and_cache, which ignores stream "
                        "core limits", self._kernels.version)

    def _torch_npu(self):
        return self._npu

    @property
    def kv_write(self) -> str:
        """The KV write chosen at construction (SCATTER_ND or ATB_ND: ops/npu_core_limits.py says
        whether a core limit binds it)."""
        return self._kernels.kv_write

    def check_kv_spec(self, spec, num_heads, device):
        """bf16, head_dim 64/128/192, and one tiny call the installed CANN must answer rightly
        (ops/npu_attention_check.py); NpuKernelsUnsupported otherwise, at start-up."""
        from epdserve.ops.npu_attention_check import check_npu_attention

        check_npu_attention(self, spec, num_heads, device)

    def reshape_and_cache(self, key, value, key_cache, value_cache, slots):
        if slots.numel() == 0:
            return
        _check_dtype(key)
        npu = self._npu
        slots = slots.to(torch.int32).contiguous()
        if self._kernels.kv_write == SCATTER_ND:
            npu.npu_scatter_pa_kv_cache(key=key.contiguous(), value=value.contiguous(), key_cache=key_cache,
                                        value_cache=value_cache, slot_mapping=slots, cache_mode="Norm")
        else:
            npu._npu_reshape_and_cache(key=key.contiguous(), value=value.contiguous(), key_cache=key_cache,
                                       value_cache=value_cache, slot_indices=slots)

    def varlen_attention(self, query, key_cache, value_cache, batch, scale):
        """query [T, heads, D] of every request in `batch` (a VarlenBatch) → [T, heads, D], one FIA call."""
        if query.shape[0] == 0:  # the kernel rejects an empty block table
            return query.new_empty(query.shape)
        _check_dtype(query, _ATTENTION_DTYPES)
        if batch.q_ends[-1] > len(batch.q_ends):  # a request with more than one query token
            _check_block_size(key_cache.shape[1])
        args = (query.contiguous(), *_paged_kv(key_cache, value_cache))
        kwargs = dict(atten_mask=self._causal_mask(query.device), sparse_mode=3,
                      block_table=batch.block_tables, actual_seq_lengths=list(batch.q_ends),
                      actual_seq_lengths_kv=list(batch.kv_lens), **_heads_and_layout(query, key_cache, scale))
        if batch.graph_tasks is not None:  # inside a decode graph's capture: a re-issuable task group
            return batch.graph_tasks.capture(*args, kwargs, batch.block_tables.shape[1] * key_cache.shape[1])
        out, _ = self._torch_npu().npu_fused_infer_attention_score(*args, **kwargs)
        return out

    def graphs_unavailable_reason(self) -> str | None:
        """Why this torch_npu's operators cannot be captured re-issuably (ops/npu_schema.py
        `graph_fia_missing`: the FIA `.out` and max-workspace schemas), or None."""
        return graph_fia_missing(self._kernels.version)

    def graph_tasks(self):
        """A new `FiaGraphTasks` (ops/npu_graph_fia.py) for one decode graph: its attention calls,
        re-issued with each step's lengths before a replay, on this ops' update stream (one
        torch_npu.npu.Stream, made at the first capture)."""
        from epdserve.ops.npu_graph_fia import FiaGraphTasks

        if self._update_stream is None:
            self._update_stream = self._npu.npu.Stream()
        return FiaGraphTasks(self._npu, self._update_stream)

    def decode_attention(self, query, key_cache, value_cache, block_tables, ctx_lens, scale):
        """The PagedOps call for callers outside the engine (benchmarks, checks): reads `ctx_lens`
        back to the host (the engine's steps use `varlen_attention` with host lengths instead)."""
        b = query.shape[0]
        return self.varlen_attention(query, key_cache, value_cache, VarlenBatch(
            block_tables.to(torch.int32), tuple(range(1, b + 1)), tuple(ctx_lens.tolist())), scale)

    def prefill_attention(self, query, key_cache, value_cache, block_table, ctx_len, scale):
        return self.varlen_attention(query, key_cache, value_cache, VarlenBatch(
            block_table.to(torch.int32).reshape(1, -1), (query.shape[0],), (int(ctx_len),)), scale)

    def _causal_mask(self, device: torch.device) -> torch.Tensor:
        mask = self._masks.get(device)
        if mask is None:  # built as vllm-ascend's AttentionMaskBuilder.get_splitfuse_attn_mask does
            n = _CAUSAL_MASK_SIZE
            mask = self._masks[device] = torch.triu(torch.ones(n, n), diagonal=1).to(torch.int8).to(device)
        return mask


def _paged_kv(key_cache: torch.Tensor, value_cache: torch.Tensor):
    """The caches as the kernel's paged key/value: [num_blocks, block_size, kv_heads * head_dim]."""
    nb, bs = key_cache.shape[:2]
    return key_cache.view(nb, bs, -1), value_cache.view(nb, bs, -1)


def _heads_and_layout(query: torch.Tensor, key_cache: torch.Tensor, scale: float) -> dict:
    return dict(num_heads=query.shape[1], num_key_value_heads=key_cache.shape[2], scale=float(scale),
                input_layout="TND", block_size=key_cache.shape[1])


def _check_dtype(t: torch.Tensor, allowed=_KERNEL_DTYPES) -> None:
    if t.dtype not in allowed:
        names = "/".join(str(d).removeprefix("torch.") for d in allowed)
        raise TypeError(f"torch_npu's paged-KV kernels take {names} here, not {t.dtype}: "
                        "run the model in bfloat16 on NPU")


def _check_block_size(block_size: int) -> None:
    if block_size % 128 or not 128 <= block_size <= 512:
        raise ValueError(f"npu_fused_infer_attention_score needs a KV block size that is a multiple of 128 "
                         f"in [128, 512] for prefill chunks, got {block_size} (NpuPlatform.kv_block_size is 128)")
