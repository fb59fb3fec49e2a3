"""`HostReads`: counts device→host reads, host→device copies and the stream synchronizations they
cost, for code that runs on the CPU in place of a device.

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

Copies, as torch_npu makes them (Ascend/pytorch torch_npu/csrc/aten/ops/op_api/CopyKernelOpApi.cpp
`copy_between_host_and_device_opapi`, the same on v2.8.0-7.2.0, v2.9.0-7.3.0 and v2.12.0-26.1.0):
- a host→device copy (`h2d`) is a call that moves host data to the device: `.to(device)` /
  `.cuda` / `.npu` of a host tensor, `copy_` of a host tensor into a resident one, and a
  data-bearing factory given a device (`tensor`, `as_tensor`, `asarray`: torch builds the data on
  the host, then copies it with non_blocking=False, torch/csrc/utils/tensor_new.cpp
  internal_new_from_data). Factories without data (`empty`, `zeros`, `arange` with `device=`)
  copy nothing;
- a copy with non_blocking=False calls `aclrtSynchronizeStream(stream)` before the memcpy: a sync;
- a non_blocking copy from host memory that torch_npu's pinned host allocator did not allocate
  (pageable memory) is turned synchronous too: `process_non_blocking_copy` ->
  `process_unregistered_mem_location_type` -> AclrtSynchronizeStreamWithTimeout (2.9 / 2.12;
  CachingHostAllocator.cpp `recordEvent`, "Sync when host memory is allocated by malloc", on 2.8):
  a sync;
- a non_blocking copy from pinned memory only records an event on the stream: no sync. Pinned
  tensors are those made by `pin_memory()` or a factory's `pin_memory=True` (on this CPU-only torch
  neither can allocate pinned memory, so here they return host memory, marked pinned);
- every host read above is a device→host copy (`d2h`) made blocking (`.cpu()` / `.item()` run
  `copy_` with non_blocking=False): a sync.
`counts()` gives {"h2d", "d2h", "syncs"}; `clear()` starts the next step's count.
"""
from __future__ import annotations

import traceback
from dataclasses import dataclass

import torch
from torch.overrides import TorchFunctionMode
from torch.utils._pytree import tree_leaves

_VALUE_READS = {"item", "tolist", "__bool__", "__int__", "__float__", "__index__", "__complex__", "numpy",
                "__array__", "__repr__", "__format__", "equal", "allclose", "is_nonzero"}
_SHAPE_READS = {"nonzero", "argwhere", "masked_select", "unique", "unique_consecutive"}
_DATA_FACTORIES = {"tensor", "as_tensor", "asarray"}  # build on the host, then copy (non_blocking=False)
_MOVES = {"to", "cuda", "npu"}


@dataclass(frozen=True)
class Copy:
    direction: str  # "h2d" or "d2h"
    call: str
    pinned: bool
    non_blocking: bool
    where: str

    @property
    def syncs(self) -> bool:
        """CopyKernelOpApi.cpp: blocking -> aclrtSynchronizeStream; non_blocking from pageable
        memory -> AclrtSynchronizeStreamWithTimeout; non_blocking from pinned memory -> no sync."""
        return not (self.non_blocking and self.pinned)


class HostReads(TorchFunctionMode):
    def __init__(self):
        super().__init__()
        self.reads: list[tuple[str, str]] = []  # (call, where in epdserve / the test it came from)
        self.copies: list[Copy] = []  # host<->device copies, in order
        self._resident: dict[int, torch.Tensor] = {}  # id -> tensor (held, so ids are not reused)
        self._pinned: dict[int, torch.Tensor] = {}  # id -> host tensor in (fake) pinned memory
        self._paused = 0

    def counts(self) -> dict[str, int]:
        """{"h2d", "d2h", "syncs"} since the start (or the last `clear`)."""
        return {"h2d": sum(c.direction == "h2d" for c in self.copies),
                "d2h": sum(c.direction == "d2h" for c in self.copies),
                "syncs": sum(c.syncs for c in self.copies)}

    def clear(self) -> None:
        self.reads.clear()
        self.copies.clear()

    def is_pinned(self, t: torch.Tensor) -> bool:
        """Pinned-ness belongs to the memory, so a view (a slice of a pinned buffer) is pinned too,
        as torch's `is_pinned` answers from the pointer (the host allocator's blocks)."""
        ptr = t.untyped_storage().data_ptr()
        return any(p.untyped_storage().data_ptr() == ptr for p in self._pinned.values())

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
        if name == "pin_memory" or kwargs.get("pin_memory"):  # no pinned allocator here: host memory, marked
            out = args[0].clone() if name == "pin_memory" else func(*args, **{**kwargs, "pin_memory": False})
            self._pinned[id(out)] = out
            return out
        hot = [t for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor) and self.is_resident(t)]
        if hot and self._reads(name, args, kwargs):
            self.reads.append((name, _caller()))
            if name in _VALUE_READS:  # the value comes back through a blocking copy
                self.copies.append(Copy("d2h", name, False, False, _caller()))
        self._copies_in(name, args, kwargs, hot)
        out = func(*args, **kwargs)
        if hot or _to_device(name, args, kwargs):
            self.mark(*(t for t in tree_leaves(out) if isinstance(t, torch.Tensor)))
        return out

    def _copies_in(self, name: str, args, kwargs, hot: list) -> None:
        """Record the host->device copy (if any) the call makes, before it runs."""
        non_blocking = bool(kwargs.get("non_blocking", False))
        if name in _DATA_FACTORIES and kwargs.get("device") is not None:
            src = args[0] if args else kwargs.get("data")
            pinned = isinstance(src, torch.Tensor) and self.is_pinned(src)
            self.copies.append(Copy("h2d", name, pinned, False, _caller()))  # non_blocking=False: tensor_new.cpp
        elif name in _MOVES and not hot and _to_device(name, args, kwargs):
            src = args[0]
            if name == "to" and len(args) > 2 and isinstance(args[2], bool):  # to(device, dtype, non_blocking)
                non_blocking = args[2]
            self.copies.append(Copy("h2d", name, self.is_pinned(src), non_blocking, _caller()))
        elif name == "copy_" and len(args) > 1 and self.is_resident(args[0]) and not self.is_resident(args[1]):
            non_blocking = bool(args[2]) if len(args) > 2 else non_blocking
            self.copies.append(Copy("h2d", name, self.is_pinned(args[1]), non_blocking, _caller()))
        elif name == "cpu" and hot:
            self.copies.append(Copy("d2h", name, False, non_blocking, _caller()))

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
    return name in _MOVES and (name != "to" or any(isinstance(a, (torch.device, str)) for a in args[1:]))


def _caller() -> str:
    for frame in reversed(traceback.extract_stack()):
        if "/torch/" not in frame.filename and not frame.filename.endswith("host_reads.py"):
            return f"{frame.filename.rsplit('/', 2)[-1]}:{frame.lineno} {frame.name}"
    return "?"
