"""How the fake torch_npu destroys an HCCL communicator while an operation still runs. Tests only.

Sources:
- CANN HcclCommDestroy (hcclapiref hcclcpp_07_0010, CANN 8.0.0 and 8.5.0; cann/hcomm
  docs/zh/api_ref/comm_mgr_c/HcclCommDestroy.md): called across threads while the communicator is
  in use (a communication operator executing) it returns HCCL_E_AGAIN ("comm is in use, please
  try again later") and destroys nothing; only an idle (or link-setup-stuck) communicator is
  destroyed, its running operator then failing at once ("Terminating operation due to external
  request"). HCCL_E_AGAIN = 20 (torch_npu third_party/hccl/inc/hccl/hccl_types.h).
- Ascend/pytorch (v2.8.0-7.2.0, v2.9.0-7.3.0, v2.12.0-26.1.0, master)
  `torch_npu/csrc/distributed/HCCLUtils.cpp` HCCLComm::destroyHcclComm calls HcclCommDestroy
  (hcclCommDestroy on 2.12 / master), ignores its result and sets `hcclComm_ = nullptr`;
  `ProcessGroupHCCL.cpp` abortAndClearHcclComm -> abortCommsFromMap -> destroyHcclComm, then
  clears devHCCLCommMap_. So torch_npu never retries, and a second `abort_hccl_comm` finds no
  communicator: the running operation keeps its HCCL stream until HCCL_EXEC_TIMEOUT, then fails
  as a device task exception.
"""
from __future__ import annotations

import threading
import time

HCCL_SUCCESS = 0
HCCL_E_AGAIN = 20


class StuckStreams:
    """HCCL streams (by stream id, per device) held by an operation a destroy could not end."""

    def __init__(self):
        self._lock = threading.Lock()
        self._until: dict[tuple[int, int], float] = {}

    def hold(self, device: int, stream_id: int, seconds: float) -> None:
        with self._lock:
            self._until[(device, stream_id)] = time.monotonic() + seconds

    def held(self, device: int, stream_id: int) -> bool:
        with self._lock:
            return time.monotonic() < self._until.get((device, stream_id), 0.0)

    def wait_free(self, device: int, stream_id: int, stop) -> None:
        """Block while the stream is held (work queued behind the stuck task), or until `stop()`."""
        while self.held(device, stream_id) and not stop():
            time.sleep(0.01)
