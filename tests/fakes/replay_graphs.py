"""`ReplayGraphsPlatform`: the CPU platform with "graphs" that replay by rerunning the captured
function — tests only.

It checks what the graph runner owns on a machine without CUDA: the bucket layout (inputs
uploaded into the static buffer at the offsets the captured body reads), padding rows that
write only the KV cache's padding block, buckets and widths chosen per step, the logits read
from the static output. What it cannot check is capturability (a body that branched on device
values would still rerun correctly here); that is the device check's job on a GPU
(`epdserve bench device`).
"""
from __future__ import annotations

from epdserve.platform.cpu import CpuPlatform


class _Replay:
    def __init__(self, fn, out):
        self.fn, self.out, self.replays = fn, out, 0

    def replay(self) -> None:
        self.out.copy_(self.fn())
        self.replays += 1


class ReplayGraphsPlatform(CpuPlatform):
    has_graphs = True

    def __init__(self):
        self.captured: list[_Replay] = []

    def graph_pool(self):
        return None

    def capture_graph(self, fn, pool):
        out = fn()
        g = _Replay(fn, out)
        self.captured.append(g)
        return g, out


class FailingGraphsPlatform(ReplayGraphsPlatform):
    """A platform whose captures fail (a driver or an operator that cannot be captured)."""

    def capture_graph(self, fn, pool):
        raise RuntimeError("operation not permitted when stream is capturing")
