"""Ascend NPU platform: device, HCCL, streams, core limits and decode graphs (npu_graphs.py). torch_npu is imported lazily, here,
in ops/npu_ops.py (the paged kernels) and by `epdserve doctor` (to show a broken install's error).

HCCL groups are built directly as ProcessGroupHCCL over the pair's store (no global world), as
vllm-ascend's netloader does; stage co-location uses torch.npu stream resource limits
(AI Core "cube" and Vector Core counts) where the installed torch_npu has them (which operators
honour them: docs/npu-colocation.md). Streams come from `NpuStreamBook` (`npu_streams.py`):
never one of HCCL's, never one another worker or pair holds. NPU streams have no priority that
reaches the device (torch_npu creates every pool stream at ACL priority 0), so `new_stream`
ignores `priority`.
"""
from __future__ import annotations

import importlib
import importlib.util
import logging
import math
import os

from epdserve.platform.base import Platform
from epdserve.platform.npu_graphs import capture_npu_graph, graph_api_missing
from epdserve.platform.npu_streams import NpuStreamBook

log = logging.getLogger(__name__)


def import_torch_npu():
    """torch_npu, imported (registering its operators and torch.npu): the one place outside
    ops/ that imports it; engine and check code call this instead."""
    return importlib.import_module("torch_npu")


def torch_npu_installed() -> bool:
    """Is torch_npu importable-in-principle here (without importing it)?"""
    try:
        return importlib.util.find_spec("torch_npu") is not None
    except ValueError:  # already in sys.modules without a spec (imported, or a test's stand-in)
        return True


HCCL_EXEC_TIMEOUT_DEFAULT_S = 1836.0  # ProcessGroupHCCL.cpp defaultExecTimeout: HCCL's own when unset
STUCK_MARGIN_S = 30.0  # for the device task exception to land after HCCL_EXEC_TIMEOUT


def exec_timeout_bound_s(value: str | None) -> float:
    """How long a receive left running by a torn-down pair may still write: HCCL_EXEC_TIMEOUT (s)
    plus a margin; `math.inf` where it may never time out. torch_npu reads the variable with
    strtol (OptionsManager.cpp GetHCCLExecTimeout, v2.8.0-7.2.0 / v2.9.0-7.3.0 / v2.12.0-26.1.0)
    and treats 0 as "never timeout" (ProcessGroupHCCL.cpp, the HCCL_EVENT_TIMEOUT warning), so 0,
    a negative value, and anything that is not a plain integer ("0.5" and "abc" are 0 to strtol)
    give no bound we can trust."""
    if value is None or not value.strip():
        return HCCL_EXEC_TIMEOUT_DEFAULT_S + STUCK_MARGIN_S
    try:
        seconds = int(value.strip())
    except ValueError:
        seconds = 0
    if seconds <= 0:
        log.warning("HCCL_EXEC_TIMEOUT=%r: HCCL may never time out, so a KV receive stuck after its pair's teardown "
                    "keeps its blocks for ever (never reused); export a finite whole number of seconds, e.g. 600",
                    value)
        return math.inf
    return seconds + STUCK_MARGIN_S


class NpuPlatform(Platform):
    name = "npu"
    dist_backend = "hccl"
    visible_devices_env = "ASCEND_RT_VISIBLE_DEVICES"
    # npu_fused_infer_attention_score with a block table needs a multiple of 128 (<= 512) when a
    # query has more than one token; vllm-ascend's kernels support only 128 (ops/npu_ops.py).
    kv_block_size = 128

    def __init__(self):
        self.streams = NpuStreamBook()  # one per process, as torch_npu's stream pools are
        self.device_limited = False  # set_device_limit succeeded in this process (stream limits need it first)

    def _torch_npu(self):
        return import_torch_npu()

    def torch_npu_version(self) -> str:
        """The imported torch_npu's own `__version__` (what the first-run table prints)."""
        return str(self._torch_npu().__version__)

    def has_profiler(self) -> bool:
        """Whether torch_npu's profiler is present (`profile_kernels` needs it)."""
        return hasattr(self._torch_npu(), "profiler")

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

    def set_thread_stream(self, stream) -> None:
        # torch_npu/npu/utils.py set_stream: the calling thread's current stream
        self._torch_npu().npu.set_stream(stream)

    def synchronize(self) -> None:
        self._torch_npu().npu.synchronize()

    @property
    def has_graphs(self) -> bool:
        return self.graphs_unavailable_reason() is None

    def graphs_unavailable_reason(self) -> str | None:
        """Why decode graphs are off here (platform/npu_graphs.py `graph_api_missing`), or None."""
        try:
            torch_npu = self._torch_npu()
        except Exception as e:
            return f"torch_npu failed to import: {type(e).__name__}: {e}"
        return graph_api_missing(torch_npu)

    def graph_pool(self):
        return self._torch_npu().npu.graph_pool_handle()

    def capture_graph(self, fn, pool):
        return capture_npu_graph(self._torch_npu(), fn, pool)

    def new_stream(self, priority: int = 0):
        """A stream of our own (`NpuStreamBook.take`); `priority` does not reach an NPU: every
        stream of torch_npu's pools is created at ACL priority 0 (NPUStream.cpp
        initDeviceStreamState), and Stream.priority raises (Stream.cpp THNPStream_get_priority)."""
        return self.streams.take(self._torch_npu().npu)

    def release_stream(self, stream) -> None:
        if self.streams.give_back(stream):  # the limit outlives its holder (op-plugin torch_npu-reset_stream_limit.md)
            reset = getattr(self._torch_npu().npu, "reset_stream_limit", None)
            try:
                if reset is not None:
                    reset(stream)
            except Exception as e:
                log.warning("reset_stream_limit failed (%s); a later holder of stream %s keeps its core limit", e,
                            getattr(stream, "stream_id", "?"))

    def pair_stream_conflict(self, pg, peer_rank: int) -> str | None:
        """Is the pair's HCCL stream one of ours? `_get_stream_id(p2p, peer)` (Init.cpp, every
        line; ProcessGroupHCCL::getStreamId: -1 before the communicator exists) after the handshake."""
        get_id = getattr(pg, "_get_stream_id", None)
        if get_id is None:
            return None
        sid = int(get_id(True, peer_rank))
        device = int(self._torch_npu().npu.current_device())
        if sid >= 0 and self.streams.holds(device, sid):
            return (f"HCCL took stream {sid}, one of epdserve's (TORCH_HCCL_HIGH_PRIORITY set? HCCL then draws "
                    "from the pool our streams come from)")
        return None

    def stream_context(self, stream):
        return self._torch_npu().npu.stream(stream)

    def limit_stream(self, stream, cube: int, vector: int) -> bool:
        """Restrict `stream` to `cube` AI Cores and `vector` Vector Cores. Never raises: a
        torch_npu without the API, a CANN without aclrtSetStreamResLimit (torch_npu's
        AclInterface.cpp TORCH_CHECK "Failed to find function") or an ACL error on this SoC
        leave the stream unrestricted, with a warning. The API binds only Ascend C operators and
        requires `allow_internal_format = False` (op-plugin docs, torch_npu-set_stream_limit.md)."""
        npu = self._torch_npu().npu
        if not hasattr(npu, "set_stream_limit"):
            log.warning("torch_npu has no set_stream_limit (needs CANN 8.3.RC1+); co-located stages share cores unrestricted")
            return False
        if not self.device_limited:  # op-plugin 7.2.0 / 7.3.0 / 26.0.0 torch_npu-set_stream_limit.md: after set_device_limit
            log.warning("set_stream_limit before set_device_limit (torch_npu-set_stream_limit.md asks for the device "
                        "limit first, before operators run); co-located stages share cores unrestricted")
            return False
        try:
            npu.config.allow_internal_format = False
            npu.set_stream_limit(stream, cube, vector)
            self.streams.mark_limited(stream)
        except Exception as e:  # RuntimeError from NPU_CHECK_ERROR / TORCH_CHECK, AssertionError on a bad stream
            log.warning("set_stream_limit(%d cube, %d vector) failed (%s: %s); co-located stages share cores unrestricted",
                        cube, vector, type(e).__name__, e)
            return False
        return True

    def limit_device(self, index: int, cube: int, vector: int) -> bool:
        """`torch.npu.set_device_limit(index, cube, vector)` for this process. torch_npu/npu/
        npu_config.py `set_device_limit` (v2.8.0-7.2.0, v2.9.0-7.3.0, v2.12.0-26.1.0): wrapped in
        `_call_once_class` — a second call raises RuntimeError "...has already been called, You can
        only set this interface once."; the device is an int (2.12.0 raises TypeError for anything
        else; 2.8.0 / 2.9.0 also take "npu:N" / torch.device), AssertionError "Invalid device id"
        out of range; it calls `_npu_set_device_res_limit(device, 0 = cube | 1 = vector, n)`, i.e.
        aclrtSetDeviceResLimit, which CANN documents as "after set_device, before operators run"
        (runtime API set_device_res_limit, aclpythondevg_01_1033). Never raises: False with a warning."""
        npu = self._torch_npu().npu
        if not hasattr(npu, "set_device_limit"):
            log.warning("torch_npu has no set_device_limit (needs CANN 8.3.RC1+); this process uses the whole device")
            return False
        try:
            npu.set_device_limit(int(index), cube, vector)
            self.device_limited = True
        except Exception as e:  # RuntimeError (second call, ACL error), TypeError, AssertionError
            log.warning("set_device_limit(%d, %d cube, %d vector) failed (%s: %s); this process uses the whole device",
                        index, cube, vector, type(e).__name__, e)
            return False
        return True

    def device_limit(self):
        npu = self._torch_npu().npu
        return npu.get_device_limit(npu.current_device())

    def stream_limit(self, stream):
        """{"cube_core_num", "vector_core_num"} a stream may use (npu_config.py `get_stream_limit`)."""
        return self._torch_npu().npu.get_stream_limit(stream)

    def profile_kernels(self, directory: str):
        """A context whose NPU kernels the profiler writes to `directory`, kernel_details.csv
        included: Level0, no AI Core metrics, text export (torch_npu/profiler experimental_config.py,
        profiler.py `profile`, `tensorboard_trace_handler`; the CSV's columns: checks/npu/kernel_details.py)."""
        prof = self._torch_npu().profiler
        cfg = prof._ExperimentalConfig(profiler_level=prof.ProfilerLevel.Level0, aic_metrics=prof.AiCMetrics.AiCoreNone,
                                       export_type=prof.ExportType.Text)
        return prof.profile(activities=[prof.ProfilerActivity.NPU], experimental_config=cfg,
                            on_trace_ready=prof.tensorboard_trace_handler(directory))

    # torch_npu's watchdog (ProcessGroupHCCL.cpp, checkHcclComms / WorkHCCL::handleException) rethrows in
    # its own thread and so ends the process when asyncErrorHandling_ is TearDown, the default
    # (OptionsManager::CheckUseHcclAsyncErrorHandleEnable: TORCH_HCCL_ASYNC_ERROR_HANDLING, default 1,
    # read once per process, in the first ProcessGroupHCCL's constructor).
    # TORCH_HCCL_HIGH_PRIORITY unset/0: HCCL's streams come from pool 0, ours from pool 1
    # (ProcessGroupHCCL.cpp getNPUStreamByCurrentType; npu_streams.py).
    pair_group_env = (("TORCH_HCCL_ASYNC_ERROR_HANDLING", "0"), ("TORCH_HCCL_HIGH_PRIORITY", "0"))
    # TP: torch_npu's default, TearDown — the watchdog's rethrow ends the process (see above)
    tp_group_env = (("TORCH_HCCL_ASYNC_ERROR_HANDLING", "1"), ("TORCH_HCCL_HIGH_PRIORITY", "0"))
    reads_group_env_once = True  # OptionsManager caches it at the first ProcessGroupHCCL (above)

    def stuck_work_bound_s(self) -> float | None:
        """HCCL_EXEC_TIMEOUT: a receive that survived `abort_hccl_comm` (HcclCommDestroy returned
        HCCL_E_AGAIN, ignored by torch_npu: HCCLUtils.cpp destroyHcclComm) runs on, writing into
        its buffer, until then (CANN HCCL_EXEC_TIMEOUT; 1836 s when unset: ProcessGroupHCCL.cpp
        defaultExecTimeout), plus a margin for the device task exception to land.

        `HCCL_EXEC_TIMEOUT=0` means "never time out" to CANN, and a value HCCL cannot parse gives no
        bound we can know: then the bound is `math.inf` — the request's blocks are never reused
        (KVReceiver keeps them quarantined until its receives end), never a guess after which a
        receive still running could write into blocks another request holds. The Atlas scripts
        and the Kubernetes renderer export 600 (scripts/atlas_node.sh `network_env`)."""
        return exec_timeout_bound_s(os.environ.get("HCCL_EXEC_TIMEOUT"))

    def interrupt_pair_group(self, pg, peer_rank: int) -> None:
        # Python's pg.abort() is c10d::Backend::abort(), a no-op: ProcessGroupHCCL's
        # abort(optional<string>) does not override it. The binding that destroys the
        # communicators is abort_hccl_comm (Init.cpp -> abortAndClearHcclComm -> destroyHcclComm).
        # While an operation runs, HcclCommDestroy returns HCCL_E_AGAIN and destroys nothing (CANN
        # hcclapiref HcclCommDestroy); torch_npu ignores the result, drops the handle and clears
        # its map (HCCLUtils.cpp destroyHcclComm, every line), so no retry can reach it: the
        # operation runs on until HCCL_EXEC_TIMEOUT, holding only HCCL's own stream (pool 0;
        # ours are pool 1, npu_streams.py), and the pair's threads stop waiting within their
        # drain budget. Only that pair fails.
        try:
            pg.abort_hccl_comm("epdserve: KV pair torn down")
        except Exception as e:  # must not raise: the pair is dead either way
            log.warning("abort_hccl_comm failed: %s", e)

    def make_pair_group(self, store, rank, world_size, timeout, group_name="", host=None, tensor_parallel=False):
        # As torch_npu's registry/distributed.py and vllm-ascend's netloader_pg.py build it.
        self.prepare_pair_groups(tensor_parallel)
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
