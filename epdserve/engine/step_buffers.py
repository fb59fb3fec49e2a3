"""`StepBuffers`: the persistent buffers a step's integer inputs travel through, one upload a step.

A step packs every integer it needs (token ids, M-RoPE positions, rows that sample, KV slots,
block tables, context lengths: ops/attention_meta.py `StepPacker`) into one byte buffer. On an
accelerator the bytes are written into a persistent pinned host buffer and copied with ONE
non-blocking host→device copy into a persistent device buffer (a pageable or blocking copy would
synchronize the stream: torch_npu's copy does `aclrtSynchronizeStream`, CUDA's waits for the
copy); the step's tensors are views of that device buffer. Two host buffers alternate, each
guarded by an event recorded after its copy, so packing step k+1 never overwrites bytes step k's
copy may still be reading. On the CPU nothing is copied: the views are of the packed bytes.

`dest` lets a caller (the decode graphs) name the device buffer the bytes land in, so a captured
graph reads its inputs where they were uploaded, with no second copy.
"""
from __future__ import annotations

import numpy as np
import torch

from epdserve.ops.attention_meta import StepPacker


class StepBuffers:
    def __init__(self, device: torch.device, platform, capacity: int = 1 << 16, stage: bool | None = None):
        """`stage`: copy through the host buffers even on the CPU (tests of the accelerator path
        on a stand-in device); default: only where the device is not the CPU."""
        self.device = device
        self.platform = platform
        self.on_host = device.type == "cpu" if stage is None else not stage
        self.capacity = 0
        self._initial = capacity
        self._host: list[torch.Tensor] = []
        self._events: list[object | None] = []
        self._dev: torch.Tensor | None = None
        self._turn = 0

    def _grow(self, need: int) -> None:
        """(Re)allocate the buffers for `need` bytes, lazily at the first upload that needs them."""
        cap = max(need, 2 * self.capacity, self._initial)
        self._host = [torch.empty(cap, dtype=torch.uint8, pin_memory=True) for _ in range(2)]
        self._events = [None, None]
        self._dev = torch.empty(cap, dtype=torch.uint8, device=self.device)
        self.capacity = cap

    def upload(self, packer: StepPacker, dest: torch.Tensor | None = None) -> list[torch.Tensor]:
        """The packed parts as tensors on the device (one non-blocking copy; none on the CPU)."""
        n = packer.nbytes
        if self.on_host:
            data = torch.frombuffer(packer.buf, dtype=torch.uint8) if n else torch.empty(0, dtype=torch.uint8)
            if dest is not None:  # a buffer a captured graph reads: the bytes must land in it
                dest[:n].copy_(data)
                data = dest
            return packer.views(data)
        if n > self.capacity:
            self._grow(n)
        turn, self._turn = self._turn, self._turn ^ 1
        host, event = self._host[turn], self._events[turn]
        if event is not None:
            event.synchronize()  # the copy that last read this host buffer is done (normally long ago)
        host.numpy()[:n] = np.frombuffer(packer.buf, dtype=np.uint8)
        target = dest if dest is not None else self._dev
        target[:n].copy_(host[:n], non_blocking=True)
        self._events[turn] = self.platform.record_event()
        return packer.views(target)
