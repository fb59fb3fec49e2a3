"""CUDA platform: NCCL for KV transfer; co-located stages get one CUDA stream each; decode steps
replay CUDA graphs (torch.cuda.CUDAGraph, captured with `torch.cuda.graph`).

A capture whose body raises is left properly (`capture_graph`): `torch.cuda.graph`'s exit runs
`capture_end`, whose `cudaStreamEndCapture` fails on the invalidated capture and raises before
`endAllocateToPool` in torch's c10 CUDAGraph.cpp (the order of several releases), and before the
exit restores the thread's stream (torch/cuda/graphs.py `graph.__exit__`: capture_end, then the
stream context's exit). So after a failure the thread's stream is set back, the allocator is told
the capture ended (best effort: `torch._C`'s end-allocate-to-pool call, where this torch has it),
and the body's own exception, with its traceback, is what the caller gets — not capture_end's.
Read from the sources; never run on a GPU here.
"""
from __future__ import annotations

import torch

from epdserve.platform.base import Platform, capture_body


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
        before = torch.cuda.current_stream()
        # thread_local: another thread's CUDA calls (KV receivers, a co-located engine) during a
        # capture are not errors; only this thread's unsafe calls would be
        out = capture_body(torch.cuda.graph(graph, pool=pool, capture_error_mode="thread_local"), fn,
                           lambda: _leave_failed_capture(before, pool))
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


def _leave_failed_capture(stream, pool) -> None:
    """The thread's stream back to `stream`, and the caching allocator out of capture mode for
    `pool` (a no-op error where capture_end already did it)."""
    torch.cuda.set_stream(stream)
    end = getattr(torch._C, "_cuda_endAllocateToPool", None) or getattr(torch._C, "_cuda_endAllocateCurrentStreamToPool", None)
    if end is not None and pool is not None:
        try:
            end(torch.cuda.current_device(), pool)
        except RuntimeError:  # not recording to this pool any more: capture_end got that far
            pass
