"""A co-located stage's own device stream: created on the stage's thread, limited to the stage's
share of the device's AI Cores and Vector Cores where the platform can (NPU `set_stream_limit`).

Nothing here may stop a worker from starting: a platform without streams (CPU) gets None, and a
device whose core limits cannot be read or set (an older torch_npu or CANN, a SoC without
aclrtSetStreamResLimit) gets an unrestricted stream and a warning.
"""
from __future__ import annotations

import logging

log = logging.getLogger(__name__)


def open_stage_stream(platform, share: float | None, name: str, priority: int = 0):
    """A new stream at `priority` for the calling stage thread, limited to `share` (0..1) of the
    device's cores where supported (None: unlimited); None where the platform has no streams."""
    platform.synchronize()  # weights and KV blocks were initialised on the default stream
    stream = platform.new_stream(priority)
    if stream is None or share is None:
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
