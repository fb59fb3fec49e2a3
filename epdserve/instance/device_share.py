"""The process's share of its NPU: `--device-core-share` as `torch.npu.set_device_limit`, once
per process, after the device is set and before the first operator (the checkpoint's load), so
that an E process beside a P process on one device keeps to its AI Cores and Vector Cores.

torch_npu allows one call per process (npu_config.py `set_device_limit`, `_call_once_class`) and
CANN's aclrtSetDeviceResLimit must come before operators run (runtime API
set_device_res_limit); the limit binds what a stream limit binds — Ascend C operators only — so
it is set only where none of the process's operators is known to ignore it
(ops/npu_core_limits.py). Stage streams opened later split the process's share, not the device.
"""
from __future__ import annotations

import logging

from epdserve.instance.stage_stream import limit_allowed
from epdserve.ops.npu_core_limits import StageOperator, stage_operators

log = logging.getLogger(__name__)


def process_operators(roles: list[str], kv_write: str | None) -> list[StageOperator]:
    """Every operator the workers of `roles` launch (each once)."""
    seen: dict[str, StageOperator] = {}
    for role in roles:
        for op in stage_operators(role, kv_write):
            seen.setdefault(op.name, op)
    return list(seen.values())


def apply_device_share(platform, index: int, share: float | None, roles: list[str], kv_write: str | None,
                       opted_in: bool = False) -> bool:
    """Limit this process to `share` of device `index`'s cores (None: the whole device). True
    when the limit was set; never raises. Off by default where an operator is unverified
    (`limit_allowed`, instance/stage_stream.py); `opted_in`: --npu-core-limits."""
    if share is None:
        return False
    if getattr(platform, "name", "") != "npu":
        log.warning("--device-core-share applies to NPUs only (torch.npu.set_device_limit); ignored on %s",
                    getattr(platform, "name", "?"))
        return False
    if not limit_allowed(process_operators(roles, kv_write), f"instance ({'+'.join(roles)})", what="device",
                         opted_in=opted_in):
        return False
    try:
        total = platform.device_limit()
    except Exception as e:
        log.warning("cannot read the device's core counts (%s); this process uses the whole device", e)
        return False
    cube = max(1, int(total["cube_core_num"] * share))
    vector = max(1, int(total["vector_core_num"] * share))
    if platform.limit_device(index, cube, vector):
        log.info("this process limited to %d cube / %d vector cores of NPU %d", cube, vector, index)
        return True
    return False
