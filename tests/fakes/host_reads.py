"""`HostReads`: counts device→host reads (syncs) of code that runs on the CPU in place of a device.

Tests only. Every tensor here lives in host memory, so which tensors are "on the device" is
tracked, by a TorchFunctionMode that sees every torch call: a tensor is device-resident when
`mark`ed (model weights, the KV cache), when a call made it with an explicit `device=` (how the
engine uploads), when `.to(...)` was given a device, or when it is the result of a call that had a
resident input. A host read is what, on an accelerator, makes the host wait for the device and
copy data back:
- a Python value of a resident tensor: `item`, `tolist`, `bool` / `int` / `float` / `index`,
  `numpy`, `repr`, and `torch.equal` / `allclose` / `is_nonzero`;
- a call whose OUTPUT SHAPE depends on a resident tensor's values: `nonzero`, `argwhere`,
  `masked_select`, `unique`, indexing with a resident boolean mask, `repeat_interleave` with
  resident repeats and no `output_size`.
Code run through `kernel(fn)` is not counted (a stand-in kernel computes on the host what the
device computes on the device); its results are resident.
"""
from __future__ import annotations

import traceback

import torch
from torch.overrides import TorchFunctionMode
from torch.utils._pytree import tree_leaves

_VALUE_READS = {"item", "tolist", "__bool__", "__int__", "__float__", "__index__", "__complex__", "numpy",
                "__array__", "__repr__", "__format__", "equal", "allclose", "is_nonzero"}
_SHAPE_READS = {"nonzero", "argwhere", "masked_select", "unique", "unique_consecutive"}


class HostReads(TorchFunctionMode):
    def __init__(self):
        super().__init__()
        self.reads: list[tuple[str, str]] = []  # (call, where in epdserve / the test it came from)
        self._resident: dict[int, torch.Tensor] = {}  # id -> tensor (held, so ids are not reused)
        self._paused = 0

    def mark(self, *tensors: torch.Tensor) -> None:
        for t in tensors:
            self._resident[id(t)] = t

    def is_resident(self, t: torch.Tensor) -> bool:
        return id(t) in self._resident

    def kernel(self, fn):
        """`fn` as a device kernel: uncounted inside, its tensor results resident."""
        def run(*args, **kwargs):
            self._paused += 1
            try:
                out = fn(*args, **kwargs)
            finally:
                self._paused -= 1
            self.mark(*(t for t in tree_leaves(out) if isinstance(t, torch.Tensor)))
            return out
        return run

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if self._paused:
            return func(*args, **kwargs)
        name = getattr(func, "__name__", "")
        hot = [t for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor) and self.is_resident(t)]
        if hot and self._reads(name, args, kwargs):
            self.reads.append((name, _caller()))
        out = func(*args, **kwargs)
        if hot or _to_device(name, args, kwargs):
            self.mark(*(t for t in tree_leaves(out) if isinstance(t, torch.Tensor)))
        return out

    def _reads(self, name: str, args, kwargs) -> bool:
        if name in _VALUE_READS or name in _SHAPE_READS:
            return True
        if name in ("__getitem__", "__setitem__") and len(args) > 1:
            idx = args[1] if isinstance(args[1], tuple) else (args[1],)
            return any(isinstance(i, torch.Tensor) and i.dtype == torch.bool and self.is_resident(i) for i in idx)
        if name == "repeat_interleave":
            reps = args[1] if len(args) > 1 else kwargs.get("repeats")
            return (isinstance(reps, torch.Tensor) and self.is_resident(reps)
                    and kwargs.get("output_size") is None)
        return False


def _to_device(name: str, args, kwargs) -> bool:
    """A call that puts its result on a device: a factory or `.to` given a device."""
    if kwargs.get("device") is not None:
        return True
    return name in ("to", "cuda") and any(isinstance(a, (torch.device, str)) for a in args[1:])


def _caller() -> str:
    for frame in reversed(traceback.extract_stack()):
        if "/torch/" not in frame.filename and not frame.filename.endswith("host_reads.py"):
            return f"{frame.filename.rsplit('/', 2)[-1]}:{frame.lineno} {frame.name}"
    return "?"
