"""A CUDA graph capture whose body raises is left properly (platform/cuda.py `capture_graph`, issue
52 item 2): the thread's stream is set back, the caching allocator leaves capture mode, and the
caller gets the body's own exception, not capture_end's. No GPU here: torch's capture calls are
replaced by a stand-in that behaves as their sources do — `torch.cuda.graph.__exit__` runs
`capture_end` and only then restores the stream (torch/cuda/graphs.py); `capture_end` of an
invalidated capture fails at `cudaStreamEndCapture`, before `endAllocateToPool` (c10
CUDAGraph.cpp); `endAllocateToPool` raises when the pool is not being recorded to."""
from __future__ import annotations

import pytest
import torch

from epdserve.platform.cuda import CudaPlatform


class Device:
    def __init__(self):
        self.stream, self.recording, self.ends = "default", None, 0


@pytest.fixture
def device(monkeypatch):
    dev = Device()

    class Graph:  # torch.cuda.graph: capture_begin on entry; capture_end, then the stream, on exit
        def __init__(self, graph, pool=None, capture_error_mode="global"):
            self.pool = pool

        def __enter__(self):
            dev.stream, dev.recording = "capture", self.pool

        def __exit__(self, kind, value, tb):
            if kind is not None:  # the body failed mid-capture: cudaStreamEndCapture fails first
                raise RuntimeError("CUDA error: operation not permitted when stream is capturing")
            dev.recording = None
            dev.stream = "default"

    def end_allocate(index, pool):
        dev.ends += 1
        if dev.recording != pool:
            raise RuntimeError("endAllocatePool: not currently recording to mempool_id")
        dev.recording = None

    monkeypatch.setattr(torch.cuda, "CUDAGraph", lambda: object())
    monkeypatch.setattr(torch.cuda, "graph", Graph)
    monkeypatch.setattr(torch.cuda, "current_stream", lambda: dev.stream)
    monkeypatch.setattr(torch.cuda, "set_stream", lambda s: setattr(dev, "stream", s))
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(torch._C, "_cuda_endAllocateToPool", end_allocate, raising=False)
    return dev


def test_a_failed_capture_restores_the_stream_and_the_allocator_and_reports_the_cause(device):
    def body():
        raise ValueError("a kernel that reads the host mid-capture")

    with pytest.raises(ValueError, match="reads the host mid-capture"):
        CudaPlatform().capture_graph(body, pool=(1, 0))
    assert device.stream == "default" and device.recording is None and device.ends == 1


def test_a_capture_that_succeeds_is_left_alone(device):
    graph, out = CudaPlatform().capture_graph(lambda: "logits", pool=(1, 0))
    assert out == "logits" and device.stream == "default" and device.recording is None and device.ends == 0
