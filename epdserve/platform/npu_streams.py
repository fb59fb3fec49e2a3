"""`NpuStreamBook`: the NPU streams epdserve runs on (stage workers, KV pair threads), each a
stream no other holder of the book has and never one of HCCL's.

What torch_npu offers (Ascend/pytorch v2.8.0-7.2.0, v2.9.0-7.3.0, v2.12.0-26.1.0, master):
- `torch.npu.Stream(priority=p)` (torch_npu/csrc/npu/Stream.cpp THNPStream_pynew ->
  csrc/core/npu/NPUStream.cpp getStreamFromPool) creates no stream: it hands out one of a pool of
  32 per device (kStreamsPerPool), round-robin (get_idx), from pool `clamp(-p, 0, 1)`; both pools
  are created by initDeviceStreamState with AclrtCreateStreamWithConfig(&s, 0, ...) — ACL
  priority 0 — so `priority` picks a pool and nothing else; Stream.priority raises
  (THNPStream_get_priority "NPU dose not support Stream.get_priority() currently").
- ProcessGroupHCCL takes each communicator's stream with getNPUStreamByCurrentType
  (ProcessGroupHCCL.cpp; via getHcclNPUStream on 2.12 / master): the sync-launch pool if the
  calling thread's current stream is a sync-launch stream, else getStreamFromPool(
  TORCH_HCCL_HIGH_PRIORITY) — pool 0 unless that variable is set (getCollStreamId, for
  collectives, also takes Options.is_high_priority_stream).
- Wrapping a stream of our own (`stream_ptr`, getStreamFromExternal, ExternalStream) exists on
  master only, and its streams cannot take task-queue work (NPUStream.cpp enCurrentNPUStream
  "External NPU stream is not supported by task queue enqueue"; streams.py ExternalStream: no
  events, no synchronize).

So on every line: our streams come from pool 1 (`priority=-1`), HCCL's from pool 0 (pair groups
leave is_high_priority_stream False and TORCH_HCCL_HIGH_PRIORITY unset: `NpuPlatform`), and the
book remembers which pool-1 streams (by `stream_id`, per device) are held, drawing again past a
held one; with all 32 held it raises rather than alias. One book per process (the pool is per
process): `NpuPlatform` owns it.
"""
from __future__ import annotations

import threading

STREAMS_PER_POOL = 32  # NPUStream.cpp kStreamsPerPool = 1 << kStreamsPerPoolBits (5)
OUR_POOL_PRIORITY = -1  # getStreamFromPool: pool clamp(-priority, 0, kMaxStreamPriorities - 1) = 1


class StreamsExhausted(RuntimeError):
    """Every stream of our pool on this device is held: a new one would alias a held one."""


class NpuStreamBook:
    def __init__(self):
        self._lock = threading.Lock()
        self._held: dict[int, set[int]] = {}  # device index -> stream ids
        self._limited: set[tuple[int, int]] = set()  # (device, stream id) given a core limit by us

    def take(self, npu) -> object:
        """A pool-1 stream of the calling thread's current device that no holder of this book
        has; StreamsExhausted when all are held."""
        with self._lock:
            for _ in range(STREAMS_PER_POOL):
                stream = npu.Stream(priority=OUR_POOL_PRIORITY)
                held = self._held.setdefault(int(stream.device_index), set())
                if int(stream.stream_id) not in held:
                    held.add(int(stream.stream_id))
                    return stream
        raise StreamsExhausted(f"all {STREAMS_PER_POOL} streams of torch_npu's pool 1 on this device are held by "
                               "epdserve's workers and KV pairs")

    def mark_limited(self, stream) -> None:
        with self._lock:
            self._limited.add((int(stream.device_index), int(stream.stream_id)))

    def give_back(self, stream) -> bool:
        """The holder is done with `stream`: a later `take` may hand it out again. True when we had
        limited its cores (the limit stays on the ACL stream: the caller resets it)."""
        if stream is None:
            return False
        key = (int(stream.device_index), int(stream.stream_id))
        with self._lock:
            self._held.get(key[0], set()).discard(key[1])
            limited = key in self._limited
            self._limited.discard(key)
            return limited

    def holds(self, device_index: int, stream_id: int) -> bool:
        with self._lock:
            return int(stream_id) in self._held.get(int(device_index), set())
