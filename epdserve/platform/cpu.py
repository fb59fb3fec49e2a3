"""CPU platform: gloo for KV transfer; co-located stages share the CPU through disjoint core sets."""
from __future__ import annotations

import os

from epdserve.platform.base import Platform


class CpuPlatform(Platform):
    name = "cpu"
    dist_backend = "gloo"
    visible_devices_env = None

    def is_available(self) -> bool:
        return True

    def make_pair_group(self, store, rank, world_size, timeout, group_name=""):
        from torch.distributed import ProcessGroupGloo

        return ProcessGroupGloo(store, rank, world_size, timeout)

    @staticmethod
    def pin_cores(cores: list[int]) -> bool:
        """Pin this process (all threads) to `cores`; False where affinity is unsupported."""
        if not hasattr(os, "sched_setaffinity"):
            return False
        os.sched_setaffinity(0, set(cores))
        return True


PLATFORM = CpuPlatform()
