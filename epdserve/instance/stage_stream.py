"""A co-located stage's own device stream: created on the stage's thread, limited to the stage's
share of the device's AI Cores and Vector Cores where the platform can (NPU `set_stream_limit`).

Nothing here may stop a worker from starting: a platform without streams (CPU) gets None, and a
device whose core limits cannot be read or set (an older torch_npu or CANN, a SoC without
aclrtSetStreamResLimit) gets an unrestricted stream and a warning. A limit is set only where no
operator of the stage is known to ignore it (`operators`, ops/npu_core_limits.py: e.g. the ATB KV
write of torch_npu 2.8 / 2.9): otherwise the stream stays unrestricted and the warning names the
operator.

Off by default on NPU (`opted_in=False`): op-plugin's torch_npu-set_stream_limit.md (7.2.0, 7.3.0,
26.0.0, 26.1.0) binds only Ascend C operators and warns that limited streams running others may
hang, and no aten operator of a stage is verified to be Ascend C (ops/npu_aten_routes.py). An
operator asks for limits (`--npu-core-limits`) once `epdserve bench colocation --device npu` has
shown, on that hardware, every kernel's Block Dim within its limit and no hang.
"""
from __future__ import annotations

import logging

from epdserve.ops.npu_core_limits import StageOperator, ignoring, stage_operators, unverified

log = logging.getLogger(__name__)


def npu_stage_operators(platform, role: str, ops) -> list[StageOperator]:
    """The operators a worker of `role` launches, on an NPU (`ops`: its engine's PagedOps); [] elsewhere."""
    if getattr(platform, "name", "") != "npu":
        return []
    return stage_operators(role, getattr(ops, "kv_write", None))


def limit_allowed(operators: list[StageOperator], name: str, what: str = "stream", opted_in: bool = False) -> bool:
    """May a core limit cover `operators`? No where one ignores limits (warned, naming it); where
    some are unverified, only when the operator opted in (`opted_in`), naming them for measuring
    (docs/npu-colocation.md)."""
    blockers = ignoring(operators)
    if blockers:
        log.warning("%s: no %s core limit: %s ignore(s) core limits (op-plugin torch_npu-set_stream_limit.md: "
                    "Ascend C operators only; other operators under limited streams may hang); sharing the device "
                    "unrestricted", name, what, ", ".join(blockers))
        return False
    maybe = unverified(operators)
    if maybe and not opted_in:
        log.warning("%s: no %s core limit (off by default on NPU): not verified to run within one: %s. A limited "
                    "stream running non-Ascend C operators may hang (op-plugin torch_npu-set_stream_limit.md); opt in "
                    "with --npu-core-limits once `epdserve bench colocation --device npu` passes on this hardware",
                    name, what, "; ".join(maybe))
        return False
    if maybe:
        log.warning("%s: %s core limit set; not verified to bind %s (measure: docs/npu-colocation.md)", name, what,
                    "; ".join(maybe))
    return True


def open_stage_stream(platform, share: float | None, name: str, priority: int = 0,
                      operators: list[StageOperator] | None = None, opted_in: bool = False):
    """A new stream at `priority` for the calling stage thread, limited to `share` (0..1) of the
    device's cores where supported and every one of `operators` may run under a limit
    (`limit_allowed`; None: unlimited); None where the platform has no streams."""
    platform.synchronize()  # weights and KV blocks were initialised on the default stream
    stream = platform.new_stream(priority)
    if stream is None or share is None:
        return stream
    if not limit_allowed(operators or [], name, opted_in=opted_in):
        return stream
    limits = getattr(platform, "device_limit", None)
    try:
        total = limits() if limits else None
    except Exception as e:  # an older torch_npu: no device limits to split
        log.warning("%s: cannot read the device's core limits (%s); sharing it unrestricted", name, e)
        return stream
    if total:
        cube = max(1, int(total["cube_core_num"] * share))
        vector = max(1, int(total["vector_core_num"] * share))
        if platform.limit_stream(stream, cube, vector):
            log.info("%s: stream limited to %d cube / %d vector cores", name, cube, vector)
    return stream
