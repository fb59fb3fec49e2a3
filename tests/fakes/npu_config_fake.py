"""torch_npu/npu/npu_config.py as each torch_npu line has it, for the fake torch_npu: the
`config.allow_internal_format` switch and the device argument of `get_device_limit`. Tests only.

Read at the Ascend/pytorch commits the PyPI wheels were built from (torch_npu/version.py
git_version): 2.8.0 def48607 (branch v2.8.0-7.2.0), 2.9.0 12d689a0 (v2.9.0-7.3.0), 2.12.0
fa0f83fe (v2.12.0-26.1.0).
- `_npuConfig` (npu_config.py, the same on all three; `config = npu_config._npuConfig()` in
  torch_npu/npu/__init__.py): a classmethod `__setattr__` that turns `allow_internal_format`
  into the option ALLOW_INTERNAL_FORMAT = "enable"/"disable" (`_npu_setOption`) and stores
  nothing, and no `__getattr__`: reading `config.allow_internal_format` raises AttributeError.
  The option's default is "disable": csrc/core/npu/sys_ctrl/npu_sys_ctrl.cpp
  `SetDefaultAllowInternalFromatDisable` (called by NpuSysCtrl::Initialize) sets it where
  nothing set it before, on all three.
- `get_device_limit(device)`: 2.8.0 and 2.9.0 take `_get_device_index(device, optional=True)`
  (torch_npu/npu/utils.py: an int as is, a str or torch.device of type "npu", None = the
  current device; ValueError "Expected a npu device" for another type); 2.12.0 takes only an int
  (TypeError "device must be an int, but got <type>", bool rejected). All: AssertionError
  "Invalid device id" outside 0..device_count-1.
- `set_device_limit(device, cube_num=-1, vector_num=-1)` (`SetDeviceLimitOnce`): wrapped in
  `_call_once_class` on all three lines — a second call in the process raises RuntimeError
  "Function 'set_device_limit' has already been called, You can only set this interface once."
  (the first call counts even if it then raised); the device argument as `get_device_limit`'s on
  that line; -1 leaves that core kind unset (`_npu_set_device_res_limit` is called only for a
  value != -1). `get_device_limit` then returns the limit set (assumed: `_npu_get_device_res_limit`
  reads aclrtGetDeviceResLimit, the value aclrtSetDeviceResLimit stored; not measured).
"""
from __future__ import annotations

import torch

INT_ONLY_DEVICE_LINES = ("2.12.0",)


class NpuConfig:
    """`torch_npu.npu.config`: writes the option; no attribute to read."""

    def __init__(self, options: dict):
        object.__setattr__(self, "_options", options)

    def __setattr__(self, name, value):
        if name == "allow_internal_format":
            self._options["ALLOW_INTERNAL_FORMAT"] = "enable" if value else "disable"


def device_limit_index(line: str, device, current: int, count: int) -> int:
    """The device index `get_device_limit(device)` resolves on `line`, raising as that line does."""
    if line in INT_ONLY_DEVICE_LINES:
        if isinstance(device, bool) or not isinstance(device, int):
            raise TypeError(f"device must be an int, but got {type(device).__name__}")
        index = device
    else:
        index = _get_device_index(device, current)
    if index < 0 or index >= count:
        raise AssertionError("Invalid device id")
    return index


def _get_device_index(device, current: int) -> int:
    """torch_npu/npu/utils.py `_get_device_index(device, optional=True)`; "npu" devices are
    parsed here because a CPU-only torch does not know the device type."""
    if isinstance(device, int):
        return device
    if device is None:
        return current
    if isinstance(device, torch.device):
        kind, index = device.type, device.index
    else:
        kind, _, number = str(device).partition(":")
        index = int(number) if number else None
    if kind != "npu":
        raise ValueError(f"Expected a npu device, but got: {device}")
    return current if index is None else index


class SetDeviceLimitOnce:
    """`torch_npu.npu.set_device_limit` as one process has it: one call, then RuntimeError."""

    def __init__(self, line: str, current, count: int, cores: list[int]):
        self.line, self._current, self._count, self.cores = line, current, count, cores
        self.called = False

    def __call__(self, device, cube_num=-1, vector_num=-1) -> None:
        if self.called:
            raise RuntimeError("Function 'set_device_limit' has already been called, You can only set this "
                               "interface once.")
        self.called = True
        device_limit_index(self.line, device, self._current(), self._count)
        if cube_num != -1:
            self.cores[0] = cube_num
        if vector_num != -1:
            self.cores[1] = vector_num
