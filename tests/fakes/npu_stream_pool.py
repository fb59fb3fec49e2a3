"""The fake torch_npu's streams, as torch_npu's NPUStream.cpp hands them out. Tests only.

Read on Ascend/pytorch v2.8.0-7.2.0, v2.9.0-7.3.0, v2.12.0-26.1.0 and master (same on all four):
- `torch_npu/csrc/core/npu/NPUStream.cpp`: per device a default stream (id 0), and pools of
  `kStreamsPerPool = 1 << kStreamsPerPoolBits` = 32 streams for each of `kMaxStreamPriorities` = 2
  priorities, created once by `initDeviceStreamState` with `AclrtCreateStreamWithConfig(&s, 0,
  ACL_STREAM_FAST_LAUNCH | ACL_STREAM_FAST_SYNC)` — ACL priority 0 for both pools;
  `getStreamFromPool(priority)` picks pool `clamp(-priority, 0, 1)` and hands its streams out
  round-robin (`get_idx`: counter++ % 32), so the 33rd `Stream()` is the 1st again;
  `getStreamFromPool(bool isHighPriority)` is pool 1 when true. A sync-launch pool of
  `kSyncLaunchStreamsPerPool` = 4 (`getNPUStreamFromSyncLaunchPool`). Stream ids: `makeStreamId`
  = type << 5 | index with StreamIdType DEFAULT 0, SYNCLAUNCH 2, NORMAL 3, HIGH 4.
- `torch_npu/csrc/npu/Stream.cpp` THNPStream_pynew: `Stream(priority=p)` -> getStreamFromPool(p)
  (master alone also wraps `stream_ptr` as an external stream); `THNPStream_get_priority`:
  TORCH_CHECK(false, "NPU dose not support Stream.get_priority() currently.") -> RuntimeError;
  THNPStream_eq compares the NPUStream (so two wrappers of one pool stream are equal).
"""
from __future__ import annotations

import threading
from dataclasses import dataclass, field

STREAMS_PER_POOL = 32
SYNC_LAUNCH_STREAMS = 4
DEFAULT, SYNCLAUNCH, NORMAL, HIGH = 0, 2, 3, 4


def stream_id(kind: int, index: int) -> int:
    return kind << 5 | index


@dataclass
class DeviceStream:
    """One ACL stream of one device: what every wrapper of it shares."""

    device_index: int
    stream_id: int
    limits: tuple[int, int] | None = None
    waits_on: list = field(default_factory=list)

    @property
    def npu_stream(self) -> int:  # a stand-in for the aclrtStream pointer
        return 0x10000 * (self.device_index + 1) + self.stream_id


class StreamPool:
    """Every stream of every device of one fake torch_npu, handed out as NPUStream.cpp does."""

    def __init__(self, devices: int):
        self._lock = threading.Lock()
        self._streams = {
            (d, k, i): DeviceStream(d, stream_id(k, i))
            for d in range(devices)
            for k, n in ((DEFAULT, 1), (SYNCLAUNCH, SYNC_LAUNCH_STREAMS), (NORMAL, STREAMS_PER_POOL), (HIGH, STREAMS_PER_POOL))
            for i in range(n)
        }
        self._counters = {(d, k): 0 for d in range(devices) for k in (SYNCLAUNCH, NORMAL, HIGH)}

    def default(self, device: int) -> DeviceStream:
        return self._streams[(device, DEFAULT, 0)]

    def from_pool(self, device: int, priority: int = 0) -> DeviceStream:
        """getStreamFromPool(int priority): pool clamp(-priority, 0, 1), round-robin."""
        return self._next(device, NORMAL + min(max(-priority, 0), 1), STREAMS_PER_POOL)

    def from_sync_launch_pool(self, device: int) -> DeviceStream:
        return self._next(device, SYNCLAUNCH, SYNC_LAUNCH_STREAMS)

    def _next(self, device: int, kind: int, size: int) -> DeviceStream:
        with self._lock:
            index = self._counters[(device, kind)] % size
            self._counters[(device, kind)] += 1
        return self._streams[(device, kind, index)]


def get_priority_unsupported():
    """Stream.priority on torch_npu (Stream.cpp THNPStream_get_priority)."""
    raise RuntimeError("NPU dose not support Stream.get_priority() currently.")
