"""The `Platform` contract: one device family's device handle, dist backend and pair groups, streams, core limits."""
from __future__ import annotations

import contextlib
from abc import ABC, abstractmethod

import torch


class Platform(ABC):
    """What the rest of epdserve may ask of a device family.

    name: "cpu" | "cuda" | "npu"; dist_backend: the torch.distributed backend for KV transfer;
    visible_devices_env: the env var that restricts which devices a process sees;
    kv_block_size: the paged-KV block size (tokens) this device's attention kernels want.
    """

    name: str
    dist_backend: str
    visible_devices_env: str | None
    kv_block_size: int = 16

    @abstractmethod
    def is_available(self) -> bool: ...

    def unavailable_reason(self) -> str | None:
        """Why this platform cannot be used here, in one line (None when it can)."""
        return None if self.is_available() else f"no {self.name} device is available"

    def device(self, index: int | None = None) -> torch.device:
        return torch.device(self.name if index is None else f"{self.name}:{index}")

    def set_thread_device(self, index: int = 0) -> None:
        """Select device `index` for the calling thread: torch_npu (and CUDA) keep the current
        device per thread, so every thread that touches the device calls this first."""
        getattr(torch, self.name).set_device(index)

    def device_count(self) -> int:
        """Accelerators this process can see (torch.cuda / torch.npu device_count)."""
        return int(getattr(torch, self.name).device_count())

    def synchronize(self) -> None:
        """Wait for queued device work (no-op on CPU)."""

    def new_stream(self):
        """A stream for one stage worker, or None where streams do not exist (CPU)."""
        return None

    def stream_context(self, stream):
        return contextlib.nullcontext()

    def limit_stream(self, stream, cube: int, vector: int) -> bool:
        """Restrict a stream to a share of the device's compute units; False if unsupported."""
        return False

    def make_pair_group(self, store, rank: int, world_size: int, timeout, group_name: str = ""):
        """Build a process group over `store` without a global world (stateless group).

        `group_name` identifies the group where the backend needs it (HCCL's group_id)."""
        raise NotImplementedError(f"{self.name}: pairwise groups not implemented")

    def interrupt_pair_group(self, pg, peer_rank: int) -> None:
        """Break `pg` (from `make_pair_group`) so every wait blocked on it wakes with an error.

        Called by a pair being torn down (peer died, stalled, or closed by us); the group is
        never used again. Must not raise. Default: the backend's `abort()` (NCCL, HCCL)."""
        abort = getattr(pg, "abort", None)
        if abort is not None:
            abort()
