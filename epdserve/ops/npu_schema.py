"""`probe_npu_kernels(torch_npu)`: which KV-write call the installed torch_npu can make into
our ND cache, and whether its attention kernel takes the keywords we pass — read once, from the
operators' registered schemas (`torch.ops.<ns>.<op>.default._schema`), never from `hasattr`.

What each line the extras install registers (tests/fixtures/torch_npu/<version>.txt, extracted
from the PyPI wheels by scripts/npu_signatures.py):
- `npu::npu_scatter_pa_kv_cache`: on torch_npu 2.8.0 (op-plugin 7.2.0, Ascend/op-plugin 8286bfa)
  and 2.9.0 (op-plugin 7.3.0, 7213914) the schema has NO `cache_mode`, and
  op_plugin/ops/opapi/ScatterPaKvCacheNpuOpApi.cpp `npu_scatter_pa_kv_cache` hard-codes
  `char* cache_mode = "PA_NZ"` (the NZ layout, not ours); on 2.12.0 (op-plugin 26.1.0, 8b9c853;
  the keyword is in the 26.0.0 branch too) it takes `str? cache_mode='PA_NZ'` and passes it to
  aclnnScatterPaKvCache, so "Norm" writes the ND layout;
- `atb::_npu_reshape_and_cache(Tensor key, Tensor value, Tensor(a!) key_cache, Tensor(b!)
  value_cache, Tensor slot_indices) -> ()` on all three (op_plugin/ops/atb/ReshapeAndCachAtb.cpp,
  TORCH_LIBRARY_FRAGMENT(atb) m.def, same on 7.2.0, 7.3.0, 26.1.0): the ND layout. torch_npu
  loads it at import from lib/libop_plugin_atb.so (torch_npu/op_plugin/atb/_atb_ops.py,
  `torch.ops.load_library`; on failure, e.g. no NNAL, the op is absent and
  `torch_npu._npu_reshape_and_cache` raises on call). `torch_npu._npu_reshape_and_cache` is a
  lazy Python wrapper until first called (`_patch_atb_and_loadso`), so its schema is read from
  `torch.ops.atb`. An ATB operator ignores stream core limits (op-plugin
  torch_npu-set_stream_limit.md);
- `npu::npu_fused_infer_attention_score`: the same schema on all three lines; so are its `.out`
  overload (`..., Tensor? workspace=None, Tensor(a!) attention_out, Tensor(b!) softmax_lse`) and
  `npu::_npu_fused_infer_attention_score_get_max_workspace`, which decode graphs use
  (`graph_fia_missing`).
- the quantized matmuls the NPU's int8 linears call (npu_weight_quant_batchmatmul, npu_dynamic_quant,
  npu_quantize, npu_quant_matmul): their schemas per line and the start-up check in
  ops/npu_quant_schema.py.
`torch_npu.<op>` is `torch.ops.npu.<op>` on all three (torch_npu/utils/custom_ops.py). A call with
a keyword the schema lacks raises RuntimeError "Unknown keyword argument" (torch's
createStackForSchema), which this probe turns into a clear error at startup.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass

import torch

log = logging.getLogger(__name__)

SCATTER = ("npu", "npu_scatter_pa_kv_cache")
ATB_RESHAPE = ("atb", "_npu_reshape_and_cache")
FIA = ("npu", "npu_fused_infer_attention_score")
# the keywords ops/npu_ops.py passes to npu_fused_infer_attention_score
FIA_KEYWORDS = ("atten_mask", "actual_seq_lengths", "actual_seq_lengths_kv", "block_table", "num_heads", "scale",
                "input_layout", "num_key_value_heads", "sparse_mode", "block_size")
SCATTER_ND = "scatter_norm"  # npu_scatter_pa_kv_cache(..., cache_mode="Norm"): Ascend C, honours core limits
ATB_ND = "atb_reshape"  # _npu_reshape_and_cache: ATB, ignores core limits


class NpuKernelsUnsupported(RuntimeError):
    """The installed torch_npu cannot make a call epdserve needs."""


@dataclass(frozen=True)
class NpuKernels:
    kv_write: str  # SCATTER_ND or ATB_ND
    version: str  # torch_npu.__version__, for messages


def op_arguments(namespace: str, name: str, overload: str = "default") -> dict[str, bool] | None:
    """{argument name: keyword-only} of `namespace::name`'s `overload`; None where not registered."""
    try:
        schema = getattr(getattr(getattr(torch.ops, namespace), name), overload)._schema
    except (AttributeError, RuntimeError):
        return None
    return {a.name: a.kwarg_only for a in schema.arguments}


def probe_npu_kernels(torch_npu) -> NpuKernels:
    """Choose the KV write by the schemas torch_npu registered (torch_npu must be imported: it
    registers the operators). Raises NpuKernelsUnsupported where no call fits."""
    version = getattr(torch_npu, "__version__", "?")
    fia = op_arguments(*FIA)
    if fia is None:
        raise NpuKernelsUnsupported(f"torch_npu {version} registers no npu::npu_fused_infer_attention_score")
    missing = [k for k in FIA_KEYWORDS if k not in fia]
    if missing:
        raise NpuKernelsUnsupported(f"torch_npu {version}'s npu_fused_infer_attention_score lacks {missing}")
    scatter = op_arguments(*SCATTER)
    if scatter is not None and "cache_mode" in scatter:
        return NpuKernels(SCATTER_ND, version)
    if op_arguments(*ATB_RESHAPE) is not None:
        return NpuKernels(ATB_ND, version)
    why = ("its npu_scatter_pa_kv_cache has no cache_mode (writes only the NZ layout; the keyword arrived "
           "with op-plugin 26.0)" if scatter is not None else "it has no npu_scatter_pa_kv_cache")
    raise NpuKernelsUnsupported(
        f"torch_npu {version} cannot write the ND KV cache: {why}, and atb::_npu_reshape_and_cache is not "
        "registered (torch_npu could not load lib/libop_plugin_atb.so: install and source CANN's NNAL "
        "package, or install torch_npu 2.12.0, the [npu] extra)")


FIA_GRAPH_OUT = ("npu", "npu_fused_infer_attention_score", "out")
FIA_WORKSPACE = ("npu", "_npu_fused_infer_attention_score_get_max_workspace", "default")
FIA_OUT_KEYWORDS = FIA_KEYWORDS + ("workspace", "attention_out", "softmax_lse")


def graph_fia_missing(version: str) -> str | None:
    """Why the registered operators cannot capture the attention re-issuably in a decode graph
    (ops/npu_graph_fia.py), or None: `npu_fused_infer_attention_score.out` with a workspace and
    its outputs by name, and `_npu_fused_infer_attention_score_get_max_workspace`, each taking the
    keywords we pass (all three lines register both: tests/fixtures/torch_npu/<line>.txt)."""
    for op, wanted in ((FIA_GRAPH_OUT, FIA_OUT_KEYWORDS), (FIA_WORKSPACE, FIA_KEYWORDS)):
        args = op_arguments(*op)
        label = f"{op[1]}{'.' + op[2] if op[2] != 'default' else ''}"
        if args is None:
            return f"torch_npu {version} registers no npu::{label}"
        missing = [k for k in wanted if k not in args]
        if missing:
            return f"torch_npu {version}'s npu::{label} lacks {missing}"
    return None


def installed_kv_write() -> str | None:
    """The KV write the installed torch_npu allows (schemas only: no operator runs); None where
    it cannot be probed (reported again, with its fix, when an engine builds its ops)."""
    try:
        import torch_npu

        return probe_npu_kernels(torch_npu).kv_write
    except Exception as e:
        log.debug("cannot probe torch_npu's KV write: %s", e)
        return None
