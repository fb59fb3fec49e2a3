"""CPU platform: gloo pair groups for KV transfer (their sockets on the host named), and how to
interrupt one.

Co-located stages share the CPU through disjoint core sets chosen by epdserve.instance.affinity,
not here.
"""
from __future__ import annotations

from datetime import timedelta

import torch

from epdserve.platform.base import Platform

_INTERRUPT_TAG = 0x7E9D  # a recv nobody sends, waited 1 ms to close a gloo pair


class CpuPlatform(Platform):
    name = "cpu"
    dist_backend = "gloo"
    visible_devices_env = None

    def is_available(self) -> bool:
        return True

    def set_thread_device(self, index: int = 0) -> None:
        pass  # one host, no per-thread device

    def device_count(self) -> int:
        return 1  # the host: instances share it (core sets, not devices, split it)

    def set_thread_stream(self, stream) -> None:
        pass  # no streams on the host

    def record_event(self):
        return None  # host work is done when the call returns

    def spare_memory_bytes(self, index: int = 0) -> int | None:
        return None  # host memory: not the device's to count

    def wait_work(self, work, timeout_s: float) -> None:
        # Gloo's send/recv make progress only inside wait(): is_completed() stays False until
        # it is called, so the waiter blocks, with the same deadline as the device backends.
        work.wait(timedelta(seconds=timeout_s))

    def make_pair_group(self, store, rank, world_size, timeout, group_name="", host=None, tensor_parallel=False):
        from torch.distributed import ProcessGroupGloo

        if host is None:  # torch's default device: the hostname's address, or GLOO_SOCKET_IFNAME
            return ProcessGroupGloo(store, rank, world_size, timeout)
        # Gloo's listener and connections on `host` only (the instance's own address), as
        # torch's own helper builds the options (distributed_c10d._new_process_group_helper).
        opts = ProcessGroupGloo._Options()
        opts._timeout = timeout
        opts._devices = [ProcessGroupGloo.create_device(hostname=host)]
        return ProcessGroupGloo(store, rank, world_size, opts)

    interrupts_per_peer = True  # gloo closes one connection (the peer's) per timed-out receive

    def interrupt_pair_group(self, pg, peer_rank: int) -> None:
        # ProcessGroupGloo.abort() does not wake pending waits, but a timed-out wait does: gloo
        # then closes the whole pair, failing every pending op. So time out a private recv.
        try:
            probe = torch.zeros(1, dtype=torch.uint8)
            pg.recv([probe], peer_rank, _INTERRUPT_TAG).wait(timedelta(milliseconds=1))
        except Exception:  # the point: the timeout closes the pair and fails pending ops
            pass


PLATFORM = CpuPlatform()
