"""Ascend NPU platform: device, HCCL, streams and core limits. torch_npu is imported lazily, here,
in ops/npu_ops.py (the paged kernels) and by `epdserve doctor` (to show a broken install's error).

HCCL groups are built directly as ProcessGroupHCCL over a TCP store (no global world), as
vllm-ascend's netloader does; stage co-location uses torch.npu stream resource limits
(AI Core "cube" and Vector Core counts) where the installed torch_npu has them.
"""
from __future__ import annotations

import importlib
import importlib.util
import logging

from epdserve.platform.base import Platform

log = logging.getLogger(__name__)


def torch_npu_installed() -> bool:
    """Is torch_npu importable-in-principle here (without importing it)?"""
    try:
        return importlib.util.find_spec("torch_npu") is not None
    except ValueError:  # already in sys.modules without a spec (imported, or a test's stand-in)
        return True


class NpuPlatform(Platform):
    name = "npu"
    dist_backend = "hccl"
    visible_devices_env = "ASCEND_RT_VISIBLE_DEVICES"
    # npu_fused_infer_attention_score with a block table needs a multiple of 128 (<= 512) when a
    # query has more than one token; vllm-ascend's kernels support only 128 (ops/npu_ops.py).
    kv_block_size = 128

    def _torch_npu(self):
        return importlib.import_module("torch_npu")

    def unavailable_reason(self) -> str | None:
        """Why there is no usable NPU here (None: there is one): torch_npu missing, failing to
        import (CANN or the driver not found, a torch version it was not built for), or no device."""
        if not torch_npu_installed():
            return "torch_npu is not installed (pip install epdserve[npu]; see the README's compatibility table)"
        try:
            self._torch_npu()
        except Exception as e:  # the real reason, e.g. libhccl.so not found: CANN's set_env.sh not sourced
            return f"torch_npu is installed but failed to import: {type(e).__name__}: {e}"
        import torch

        if not (getattr(torch, "npu", None) and torch.npu.is_available()):
            return "torch_npu imported but no NPU is visible (npu-smi info; ASCEND_RT_VISIBLE_DEVICES)"
        return None

    def is_available(self) -> bool:
        return self.unavailable_reason() is None

    def set_thread_device(self, index: int = 0) -> None:
        # torch_npu/npu/utils.py set_device(device) -> torch_npu._C._npu_setDevice: per calling thread
        self._torch_npu().npu.set_device(index)

    def synchronize(self) -> None:
        import torch

        torch.npu.synchronize()

    def new_stream(self):
        import torch

        return torch.npu.Stream()

    def stream_context(self, stream):
        import torch

        return torch.npu.stream(stream)

    def limit_stream(self, stream, cube: int, vector: int) -> bool:
        import torch

        if not hasattr(torch.npu, "set_stream_limit"):
            log.warning("torch_npu has no set_stream_limit (needs CANN 8.3.RC1+); co-located stages share cores unrestricted")
            return False
        torch.npu.set_stream_limit(stream, cube, vector)
        return True

    def device_limit(self):
        import torch

        return torch.npu.get_device_limit(torch.npu.current_device())

    def make_pair_group(self, store, rank, world_size, timeout, group_name=""):
        # As torch_npu's registry/distributed.py and vllm-ascend's netloader_pg.py build it.
        torch_npu = self._torch_npu()
        c10d = torch_npu._C._distributed_c10d
        opts = c10d.ProcessGroupHCCL.Options()
        opts.is_high_priority_stream = False
        opts._timeout = timeout
        opts.global_ranks_in_group = []
        opts.group_id = group_name  # unique per pair: torch_npu identifies groups by it
        pg = c10d.ProcessGroupHCCL(store, rank, world_size, opts)
        pg._set_sequence_number_for_group()
        return pg


PLATFORM = NpuPlatform()
