"""Which operators each stage launches on an Ascend NPU, their kind, and whether a core limit
(`torch.npu.set_stream_limit` / `set_device_limit`) binds them — the table of
docs/npu-colocation.md as data, for the code that decides whether to set a limit.

op-plugin docs/context/torch_npu-set_stream_limit.md (7.2.0, 7.3.0; docs/en/custom_APIs/torch_npu/
on 26.1.0), constraints: a limit binds only operators written in Ascend C; with other operators
several limited streams may hang. So a limit is set only where no operator of the stage is known
to ignore it (an ATB operator names the stage's warning instead). The model's aten operators are
classified in ops/npu_aten_routes.py: each runs its aclnn API on A2 / A3, but whether the kernel
behind it is Ascend C is not shown for any of them, so each is UNVERIFIED and named: the limit is
set, to be checked on hardware (`epdserve bench colocation --device npu`, kernel_details Block Dim).
"""
from __future__ import annotations

from dataclasses import dataclass

from epdserve.ops.npu_aten_routes import LANGUAGE, ROUTES, VISION
from epdserve.ops.npu_schema import ATB_ND, SCATTER_ND
from epdserve.roles import role_set

HONOURS, IGNORES, UNVERIFIED = "honours", "ignores", "unverified"


@dataclass(frozen=True)
class StageOperator:
    name: str
    kind: str  # Ascend C, ATB, aclnn (kernel unknown)
    limit: str  # HONOURS, IGNORES or UNVERIFIED
    source: str


SCATTER_WRITE = StageOperator("npu_scatter_pa_kv_cache", "Ascend C", HONOURS,
                              "hicann/ops-transformer attention/scatter_pa_kv_cache/op_host/scatter_pa_kv_cache_def.cpp")
ATB_WRITE = StageOperator("_npu_reshape_and_cache", "ATB", IGNORES,
                          "Ascend/op-plugin op_plugin/ops/atb/ReshapeAndCachAtb.cpp; torch_npu-set_stream_limit.md")
FIA = StageOperator("npu_fused_infer_attention_score", "Ascend C", HONOURS,
                    "hicann/ops-transformer attention/fused_infer_attention_score")


def aten_operator(aten: str) -> StageOperator:
    r = ROUTES[aten]
    return StageOperator(f"aten::{aten} ({r.aclnn})", "aclnn (kernel unknown)", UNVERIFIED,
                         f"op-plugin op_plugin/ops/opapi/{r.opapi}; {r.kernel}")


VISION_ATEN = tuple(aten_operator(a) for a in VISION)
LM_ATEN = tuple(aten_operator(a) for a in LANGUAGE)
KV_WRITES = {SCATTER_ND: SCATTER_WRITE, ATB_ND: ATB_WRITE}


def stage_operators(role: str, kv_write: str | None) -> list[StageOperator]:
    """The operators a worker of `role` (E, P, D, PD, EPD, EP's parts, P+E) launches on an NPU,
    with `kv_write` the KV write NpuPagedOps chose (ops/npu_schema.py; None: no NPU paged
    operators, e.g. EPDSERVE_OPS=portable, where the KV write and attention are aten too)."""
    ops: list[StageOperator] = []
    rs = role_set(role)
    if rs.encodes:
        ops += VISION_ATEN
    if rs.holds_kv:
        ops += [op for op in LM_ATEN if op not in ops]
        if kv_write in KV_WRITES:
            ops += [KV_WRITES[kv_write], FIA]
    return ops


def ignoring(ops: list[StageOperator]) -> list[str]:
    """Names of the operators a core limit does not bind: a limit must not be set over them."""
    return [op.name for op in ops if op.limit == IGNORES]


def unverified(ops: list[StageOperator]) -> list[str]:
    return [op.name for op in ops if op.limit == UNVERIFIED]
