"""The host-staged KV hop: a pair's messages go device → host buffer → gloo → host buffer → device.

Owns `transport_platform` (which platform builds, waits on and breaks a pair's group for a
hop) and the staging of one message (`stage_send`, `stage_recv`, `StagedWork`).

Why: two processes on one GPU cannot form an NCCL pair (NCCL refuses two ranks on the same
device), so when `epdserve launch` puts a P and a D on the same accelerator their pairs use the
`host` hop (`deploy/kv_hop.py`): the pair group is gloo over loopback, whatever the device, and
each message is copied to a host buffer (pinned where the device has pinned memory) before it is
sent, and from one after it is received. The `device` hop is the platform's own backend (gloo on
CPU, NCCL on CUDA, HCCL on NPU) straight from and into the KV blocks.

Ordering: a send's device → host copy runs on the posting thread's current stream (the engine's,
right after the layer's KV was written) and is waited for before gloo gets the buffer; a
receive's host → device copy runs in the waiting thread once gloo has filled the buffer, and is
complete on the device before the wait returns (a blocking copy), so the receiver marks a
transfer DONE only once its blocks hold the bytes. Both copies block the host: the price of the
fallback (one extra device round trip per message; the P forward waits for each layer's copy).
"""
from __future__ import annotations

import torch

from epdserve.transfer.kv.config import HOPS



def transport_platform(platform, hop: str):
    """The platform whose backend carries a pair's messages: the device's own, or the CPU's gloo."""
    if hop not in HOPS:
        raise ValueError(f"KV hop must be one of {', '.join(HOPS)}, got {hop!r}")
    if hop == "device" or platform.name == "cpu":  # CPU: its own gloo either way
        return platform
    from epdserve.platform import get_platform

    return get_platform("cpu")


def host_buffer(nbytes: int, device: torch.device) -> torch.Tensor:
    """A uint8 host buffer of `nbytes`: pinned when the data comes from or goes to an accelerator
    (the copy is then a DMA the device runs itself), plain host memory otherwise."""
    if device.type != "cpu":
        try:
            return torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
        except RuntimeError:  # no pinned-memory allocator for this device: plain host memory
            pass
    return torch.empty(nbytes, dtype=torch.uint8)


def stage_send(data: torch.Tensor) -> torch.Tensor:
    """A host copy of `data` (flat uint8), complete when this returns: what gloo sends."""
    host = host_buffer(data.numel(), data.device)
    host.copy_(data)  # blocking: the device → host copy has landed when copy_ returns
    return host


def stage_recv(data: torch.Tensor) -> torch.Tensor:
    """The host buffer gloo receives `data`'s bytes into (copied to `data` by `StagedWork.wait`)."""
    return host_buffer(data.numel(), data.device)


class StagedWork:
    """A gloo send or receive of a host buffer, waited on like the backend's own work; a receive's
    bytes reach their destination (`dst`, flat uint8, on the device) when its wait succeeds.
    `host` (the staged buffer) lives as long as this object, so gloo never reads or writes freed
    memory."""

    def __init__(self, work, host: torch.Tensor, dst: torch.Tensor | None = None):
        self._work, self.host, self._dst = work, host, dst
        self._copied = dst is None

    def wait(self, timeout=None):
        done = self._work.wait() if timeout is None else self._work.wait(timeout)
        if not self._copied:
            # inference mode: `dst` may be an inference tensor (the sender's acknowledgement is made
            # inside the forward), which only inference mode may update in place
            with torch.inference_mode():
                self._dst.copy_(self.host)  # blocking: on the device when this returns
            self._copied = True
        return done

    def is_completed(self) -> bool:
        """Ended: failed (nothing will be copied), or done with its bytes on the device."""
        if not self._work.is_completed():
            return False
        return self._copied or self._work.exception() is not None

    def exception(self):
        return self._work.exception()
