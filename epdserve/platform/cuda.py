"""CUDA platform: NCCL for KV transfer; co-located stages get one CUDA stream each; decode steps
replay CUDA graphs (torch.cuda.CUDAGraph, captured with `torch.cuda.graph`)."""
from __future__ import annotations

import torch

from epdserve.platform.base import Platform


class CudaPlatform(Platform):
    name = "cuda"
    dist_backend = "nccl"
    visible_devices_env = "CUDA_VISIBLE_DEVICES"

    def is_available(self) -> bool:
        return torch.cuda.is_available()

    def synchronize(self) -> None:
        torch.cuda.synchronize()

    has_graphs = True

    def graph_pool(self):
        return torch.cuda.graph_pool_handle()

    def capture_graph(self, fn, pool):
        graph = torch.cuda.CUDAGraph()
        # thread_local: another thread's CUDA calls (KV receivers, a co-located engine) during a
        # capture are not errors; only this thread's unsafe calls would be
        with torch.cuda.graph(graph, pool=pool, capture_error_mode="thread_local"):
            out = fn()
        return graph, out

    def new_stream(self, priority: int = 0):
        return torch.cuda.Stream(priority=priority)

    def stream_context(self, stream):
        return torch.cuda.stream(stream)

    # ProcessGroupNCCL's watchdog: 0 = no handling (a failed pair is aborted by us, not the process)
    pair_group_env = (("TORCH_NCCL_ASYNC_ERROR_HANDLING", "0"),)
    # 1 = TearDown (ProcessGroupNCCL.hpp ErrorHandlingMode): a TP collective that fails or outlives
    # the group's timeout ends the process, which its supervisor restarts
    tp_group_env = (("TORCH_NCCL_ASYNC_ERROR_HANDLING", "1"),)

    def set_thread_device(self, index: int = 0) -> None:
        torch.cuda.set_device(index)

    def make_pair_group(self, store, rank, world_size, timeout, group_name="", host=None, tensor_parallel=False):
        from torch.distributed import ProcessGroupNCCL

        self.prepare_pair_groups(tensor_parallel)
        opts = ProcessGroupNCCL.Options()
        opts._timeout = timeout
        return ProcessGroupNCCL(store, rank, world_size, opts)


PLATFORM = CudaPlatform()
