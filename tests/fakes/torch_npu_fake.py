"""A stand-in for torch_npu that behaves as the real one does where epdserve depends on it, for
tests on a host without an NPU. Tests only; never imported by epdserve.

Every faked behaviour names the torch_npu source it copies (Ascend/pytorch, read 2026-11-30):
- `torch_npu/csrc/distributed/ProcessGroupHCCL.cpp` (PG = that file):
  * WorkHCCL::wait -> synchronizeInternal: the host does NOT block unless TORCH_HCCL_BLOCKING_WAIT=1;
    the calling thread's current stream is made to wait on the work's end event, and wait
    returns True ("Always return true, because abort API is not implemented");
  * WorkHCCL::isCompleted: `exception() || finishedNPUExecutionInternal()` (the end event fired);
  * the communicator is created lazily by the first operation, in the calling thread, with a
    blocking rendezvous of all ranks (getHCCLComm -> broadcastMasterID + HcclCommInitRootInfo);
    pointToPoint then calls SetDevice(tensor's device) on the calling thread (not faked: the
    tensors here are CPU tensors);
  * the constructor reads TORCH_HCCL_BLOCKING_WAIT per group, and the async error handling mode
    once per process (OptionsManager::CheckUseHcclAsyncErrorHandleEnable: a function-static of
    TORCH_HCCL_ASYNC_ERROR_HANDLING, default 1 = TearDown); under blocking wait the group's mode is
    NoHandling, and the watchdog starts all the same (`hcclCommWatchdogThread_ = std::thread(...)`
    on v2.8.0-7.2.0 / v2.9.0-7.3.0, `watchdog_->start()` on v2.12.0-26.1.0 / master, after the
    blocking-wait branch that only logs "NO watchdog thread is created");
  * a communicator's stream: getNPUStreamByCurrentType (via getHcclNPUStream on 2.12 / master):
    the sync-launch pool under a sync-launch current stream, else getStreamFromPool(
    TORCH_HCCL_HIGH_PRIORITY) — the same pools `Stream()` draws from (tests/fakes/npu_stream_pool.py);
    `_get_stream_id(p2p, peer)` (Init.cpp, getStreamId) its id, -1 before the communicator;
  * the watchdog (Watchdog::runLoop -> WorkHCCL::checkTimeout, handleException): a work pending
    longer than the group timeout gets "Watchdog caught collective operation timeout"; with
    SHOULD_TEAR_DOWN(mode) (mode 1 or 3) the exception is rethrown in the watchdog thread, which
    ends the process (std::terminate -> SIGABRT). Real period 1000 ms; 100 ms here;
  * `pg.abort()` from Python is c10d::Backend::abort(), a no-op: ProcessGroupHCCL's
    `bool abort(c10::optional<std::string>)` does not override torch's `virtual void abort()`
    (torch Backend.hpp); the binding that destroys communicators is `abort_hccl_comm`
    (Init.cpp -> abortAndClearHcclComm -> HCCLComm::destroyHcclComm);
  * HcclCommDestroy returns HCCL_E_AGAIN while an operation runs, which torch_npu ignores
    (tests/fakes/hccl_destroy.py): a work pending at the destroy keeps its HCCL stream — and
    every later work queued on that stream — until HCCL_EXEC_TIMEOUT (`exec_timeout_s`), then
    fails; an idle communicator is destroyed;
  * a dead peer is not an error to HCCL until HCCL_EXEC_TIMEOUT (default 1836 s, PG
    `defaultExecTimeout`): the work just stays pending, as it does here.
- `torch_npu/npu/utils.py` set_device / current_device / set_stream / current_stream: per thread.
- `Stream()`: round-robin from pools of 32 per device and priority, all at ACL priority 0;
  `Stream.priority` raises (tests/fakes/npu_stream_pool.py).
- `torch_npu/npu/__init__.py` mem_get_info(device=None) -> (free, total) from
  `_npu_getDeviceMemories` (`csrc/npu/Module.cpp`: aclrtGetMemInfo(ACL_HBM_MEM)), "Invalid device
  id" AssertionError outside 0..device_count-1; `torch_npu/npu/memory.py` memory_reserved /
  memory_allocated(device=None): the caching allocator's bytes (`FakeTorchNpu.memory`).
- `torch_npu/npu/npu_config.py` set_stream_limit: AssertionError for a stream that is not a
  torch_npu.npu.Stream; `csrc/core/npu/interface/AclInterface.cpp` AclrtSetStreamResLimit:
  TORCH_CHECK "Failed to find function aclrtSetStreamResLimit" (RuntimeError) where the CANN
  runtime lacks it — `FakeTorchNpu(stream_limits=False)`.
- `torch_npu.npu.config.allow_internal_format` (write-only; the option defaults to "disable"),
  `get_device_limit`'s device argument and `set_device_limit` (once per process), per line:
  tests/fakes/npu_config_fake.py.
- the paged-KV operators: exactly the schemas of one torch_npu line (`FakeTorchNpu(line=...)`,
  tests/fixtures/torch_npu/<line>.txt; `absent=`: a line without those operators),
  `torch_npu.<op>` and `torch.ops.npu` / `torch.ops.atb` as torch_npu binds them; calls land in
  `kernel_calls` (tests/fakes/npu_kernels_fake.py; the fused layer kernels:
  tests/fakes/npu_layer_kernels_fake.py; the quantized matmuls: tests/fakes/npu_quant_kernels_fake.py). The
  line's CANN (`cann=`, default the fixture's) decides whether FIA takes TND with a block table
  (`refuses_tnd_paged`: refused on 8.3.RC1, as vllm-ascend issues #4373 / #8045 report);
- NPU graphs (`NPUGraph`, `graph`, `graph_pool_handle`, `ExternalEvent`, graph_task_group_* /
  graph_task_update_*) and the FIA `.out` / max-workspace calls decode graphs make:
  tests/fakes/npu_graphs_fake.py, the names the line's torch_npu.npu exports (the fixture's
  "torch_npu.npu exports" line; `graph_api=False`: none of them);
- `torch_npu/npu/utils.py` get_cann_version(module="CANN") (re-exported as
  torch_npu.utils.get_cann_version on 2.8.0, 2.9.0, 2.12.0): the CANN, or `driver=` for "DRIVER";
  "" for an unknown module (GetCANNInfo.cpp GetCANNVersion).

Transport: a real ProcessGroupGloo on loopback under each fake ProcessGroupHCCL, built by the
first operation (as HCCL builds its communicator); a progress thread per group completes works
in posting order, as the device executes one HCCL stream. Tensors stay on the CPU.
"""
from __future__ import annotations

import contextlib
import os
import sys
import threading
import time
import types
from datetime import timedelta

import torch
from torch.distributed import PrefixStore, ProcessGroupGloo

from tests.fakes.npu_config_fake import NpuConfig, SetDeviceLimitOnce, device_limit_index
from tests.fakes.npu_kernels_fake import (KV_WRITES, NEWEST, line_cann, line_npu_exports, module_attributes,
                                          namespaces, refuses_tnd_paged, tnd_paged_refused)

from tests.fakes.npu_graphs_fake import FakeNpuGraphs, fia_out, get_max_workspace
from tests.fakes.npu_layer_kernels_fake import layer_kernels
from tests.fakes.npu_quant_kernels_fake import QUANT_KERNELS
from tests.fakes.hccl_destroy import HCCL_E_AGAIN, HCCL_SUCCESS, StuckStreams
from tests.fakes.npu_stream_pool import SYNCLAUNCH, DeviceStream, StreamPool, get_priority_unsupported

PRIVATE_USE1 = 20  # c10::DeviceType::PrivateUse1, the device type torch_npu registers
WATCHDOG_PERIOD_S = 0.1
_TEAR_DOWN_MODES = (1, 3)  # SHOULD_TEAR_DOWN(a): a != NoHandling(0) && a != CleanUpOnly(2)


class FakeTorchNpu:
    """One fake torch_npu: `install()` puts it in sys.modules (and torch.npu), `events` records
    what epdserve did with it: (thread name, event, details...)."""

    def __init__(self, *, stream_limits: bool = True, devices: int = 1, cores: tuple[int, int] = (20, 40),
                 line: str = NEWEST, kernels: dict | None = None, atb_loaded: bool = True, cann: str | None = None,
                 driver: str = "25.5.0", absent: tuple[str, ...] = (), graph_api: bool | None = None):
        self.line = line  # the torch_npu version whose operator schemas and npu_config this fake has
        self.cann = cann or line_cann(line)
        self.driver = driver
        self.kernel_calls: list[tuple] = []  # (operator, args, kwargs) as passed, tensors described
        self.options = {"ALLOW_INTERNAL_FORMAT": "disable"}  # npu_sys_ctrl.cpp SetDefaultAllowInternalFromatDisable
        impls = {**KV_WRITES, **layer_kernels(line), **QUANT_KERNELS, **(kernels or {})}
        fia = "npu_fused_infer_attention_score"
        if fia in impls and refuses_tnd_paged(self.cann):
            impls[fia] = tnd_paged_refused(impls[fia])
        if fia in impls:  # the decode graphs' variant (tests/fakes/npu_graphs_fake.py)
            impls.setdefault(f"{fia}.out", fia_out(impls[fia]))
        impls.setdefault(f"_{fia}_get_max_workspace", get_max_workspace)
        # the torch_npu.npu graph names this fake has: the line's (None), all (True) or none (False)
        self.graph_names = line_npu_exports(line) if graph_api is None else None if graph_api else set()
        self.graphs = FakeNpuGraphs(self)
        self.ops = namespaces(line, impls, self._record_kernel, atb_loaded=atb_loaded, absent=absent,
                              launch=self.graphs.launch)
        self.stream_limits = stream_limits
        self.devices = devices
        self.cores = list(cores)  # the device's (cube, vector) cores; set_device_limit lowers them
        # per device: (runtime-free, reserved by this process's allocator, allocated of that, total) bytes
        self.memory = {i: (48 << 30, 8 << 30, 6 << 30, 64 << 30) for i in range(devices)}
        self.events: list[tuple] = []
        self._lock = threading.Lock()
        self._local = threading.local()
        self.pool = StreamPool(devices)
        self.stuck = StuckStreams()
        self.exec_timeout_s = 1836.0  # HCCL_EXEC_TIMEOUT's default (PG defaultExecTimeout)
        self._async_error_handling: int | None = None  # read once, by the first group
        self.module = self._build_module()

    # ------------------------------------------------------------------ installing
    def install(self, monkeypatch=None) -> FakeTorchNpu:
        """Make `import torch_npu` return this fake (and `torch.npu` its npu namespace)."""
        if monkeypatch is not None:
            monkeypatch.setitem(sys.modules, "torch_npu", self.module)
            monkeypatch.setattr(torch, "npu", self.module.npu, raising=False)
            for ns, table in self.ops.items():
                monkeypatch.setattr(torch.ops, ns, table, raising=False)
        else:  # a subprocess of a test
            sys.modules["torch_npu"] = self.module
            torch.npu = self.module.npu
            for ns, table in self.ops.items():
                setattr(torch.ops, ns, table)
        return self

    def _record_kernel(self, name: str, args: tuple, kwargs: dict) -> None:
        with self._lock:
            self.kernel_calls.append((name, args, kwargs))

    def record(self, event: str, *details) -> None:
        with self._lock:
            self.events.append((threading.current_thread().name, event, *details))

    def of(self, event: str) -> list[tuple]:
        with self._lock:
            return [e for e in self.events if e[1] == event]

    # ------------------------------------------------------------------ per-thread device and stream
    def current_device(self) -> int:
        return getattr(self._local, "device", 0)

    def set_device(self, index) -> None:
        index = index if isinstance(index, int) else torch.device(index).index or 0
        if not 0 <= index < self.devices:
            raise RuntimeError(f"Invalid device ID {index}")
        self._local.device = index
        self.record("set_device", index)

    def current_stream(self) -> FakeStream:
        stream = getattr(self._local, "stream", None)
        if stream is None or stream.device_index != self.current_device():
            stream = FakeStream(self.pool.default(self.current_device()))
        return stream

    def set_stream(self, stream: FakeStream) -> None:
        self._local.stream = stream
        self.record("set_stream", stream.stream_id)

    def stream(self, stream: FakeStream) -> _StreamContext:
        return _StreamContext(self._local, stream)

    def synchronize(self, device=None) -> None:
        self.record("synchronize")

    def set_stream_limit(self, stream, cube_num=-1, vector_num=-1) -> None:
        if stream is None:
            raise AssertionError("stream cannot be None")
        if not isinstance(stream, FakeStream):
            raise AssertionError(f"stream should be torch_npu.npu.Stream, could not be {type(stream)}")
        if not self.stream_limits:
            raise RuntimeError("Failed to find function aclrtSetStreamResLimit")
        stream.limits = (cube_num, vector_num)
        self.record("set_stream_limit", stream.stream_id, cube_num, vector_num,
                    self.options["ALLOW_INTERNAL_FORMAT"] == "enable")

    def get_device_limit(self, device) -> dict:
        device_limit_index(self.line, device, self.current_device(), self.devices)
        return {"cube_core_num": self.cores[0], "vector_core_num": self.cores[1]}

    def _index(self, device) -> int:
        index = self.current_device() if device is None else (
            device if isinstance(device, int) else torch.device(device).index or 0)
        if not 0 <= index < self.devices:
            raise AssertionError("Invalid device id")
        return index

    def mem_get_info(self, device=None) -> tuple[int, int]:
        """(free, total) bytes of the device as the runtime sees it (aclrtGetMemInfo(ACL_HBM_MEM)):
        memory this process's caching allocator holds counts as used."""
        free, _, _, total = self.memory[self._index(device)]
        return free, total

    def async_error_handling(self) -> int:
        with self._lock:
            if self._async_error_handling is None:
                self._async_error_handling = int(os.environ.get("TORCH_HCCL_ASYNC_ERROR_HANDLING", "1"))
            return self._async_error_handling

    # ------------------------------------------------------------------ the module
    def _build_module(self) -> types.ModuleType:
        fake = self

        class Stream(FakeStream):
            def __init__(self, device=None, priority=0):
                index = fake.current_device() if device is None else fake._index(device)
                super().__init__(fake.pool.from_pool(index, priority))

        npu = types.ModuleType("torch_npu.npu")
        npu.set_device = self.set_device
        npu.current_device = self.current_device
        npu.device_count = lambda: self.devices
        npu.is_available = lambda: True
        npu.synchronize = self.synchronize
        npu.Stream = Stream
        npu.current_stream = lambda device=None: self.current_stream()
        npu.set_stream = self.set_stream
        npu.stream = self.stream
        npu.set_stream_limit = self.set_stream_limit
        npu.get_device_limit = self.get_device_limit
        npu.set_device_limit = SetDeviceLimitOnce(self.line, self.current_device, self.devices, self.cores)
        npu.config = NpuConfig(self.options)
        npu.mem_get_info = self.mem_get_info
        npu.memory_reserved = lambda device=None: self.memory[self._index(device)][1]
        npu.memory_allocated = lambda device=None: self.memory[self._index(device)][2]
        self.graphs.build(npu, self.graph_names)

        class Options:
            def __init__(self):
                self.is_high_priority_stream = False
                self._timeout = timedelta(minutes=30)
                self.global_ranks_in_group: list[int] = []
                self.group_id = ""

        class ProcessGroupHCCL(FakeProcessGroupHCCL):
            def __init__(self, store, rank, size, options):
                super().__init__(fake, store, rank, size, options)

        ProcessGroupHCCL.Options = Options
        mod = types.ModuleType("torch_npu")
        mod.npu = npu
        mod._C = types.SimpleNamespace(_distributed_c10d=types.SimpleNamespace(ProcessGroupHCCL=ProcessGroupHCCL))
        mod.__version__ = f"{self.line}+fake"
        versions = {"CANN": self.cann, "DRIVER": self.driver}
        mod.utils = types.SimpleNamespace(get_cann_version=lambda module="CANN": versions.get(module, ""))
        for name, op in module_attributes(self.ops).items():
            setattr(mod, name, op)
        return mod


class _StreamContext:
    """`torch.npu.stream(s)` (torch_npu/npu/utils.py StreamContext): a class, not a generator, so one
    left un-exited (a capture_end that raised in `graph.__exit__`) changes nothing when collected."""

    def __init__(self, local, stream):
        self._local, self._stream, self._before = local, stream, None

    def __enter__(self):
        self._before = getattr(self._local, "stream", None)
        self._local.stream = self._stream
        return self._stream

    def __exit__(self, *exc):
        self._local.stream = self._before


class FakeStream:
    """A torch_npu.npu.Stream: a wrapper of one device stream (several wrappers may share it)."""

    device_type = PRIVATE_USE1

    def __init__(self, stream: DeviceStream):
        self._stream = stream

    stream_id = property(lambda self: self._stream.stream_id)
    device_index = property(lambda self: self._stream.device_index)
    npu_stream = property(lambda self: self._stream.npu_stream)
    waits_on = property(lambda self: self._stream.waits_on)  # works whose end event it was made to wait on
    limits = property(lambda self: self._stream.limits,
                      lambda self, value: setattr(self._stream, "limits", value))
    priority = property(lambda self: get_priority_unsupported())

    def __eq__(self, other):
        return isinstance(other, FakeStream) and other._stream is self._stream

    def __hash__(self):
        return hash((self.npu_stream, self.device_index))


class FakeWork:
    def __init__(self, group: FakeProcessGroupHCCL, op: str, numel: int):
        self.group, self.op, self.numel = group, op, numel
        self.start = time.monotonic()
        self.done = threading.Event()
        self.error: Exception | None = None

    def is_completed(self) -> bool:
        return self.error is not None or self.done.is_set()

    def exception(self):
        return self.error

    def wait(self, timeout: timedelta = timedelta(0)) -> bool:
        fake = self.group.fake
        stream = fake.current_stream()
        stream.waits_on.append(self)  # (*hcclEndEvents_)[i].block(currentStream)
        fake.record("work.wait", self.op, stream.stream_id)
        if self.group.blocking_wait:  # synchronizeInternal's blockingWait_ branch
            deadline = time.monotonic() + (timeout.total_seconds() or 1e9)
            while not self.is_completed():
                if time.monotonic() > deadline:
                    raise RuntimeError("Work timed out in blocking wait (TORCH_HCCL_BLOCKING_WAIT=1)")
                time.sleep(0.01)
            if self.error is not None:
                raise RuntimeError(str(self.error))
        return True


class FakeProcessGroupHCCL:
    def __init__(self, fake: FakeTorchNpu, store, rank: int, size: int, options):
        self.fake, self.store, self.rank, self.size, self.options = fake, store, rank, size, options
        self.blocking_wait = os.environ.get("TORCH_HCCL_BLOCKING_WAIT", "0") == "1"
        self.error_handling = 0 if self.blocking_wait else fake.async_error_handling()  # NoHandling
        self.hccl_stream: DeviceStream | None = None
        self._lock = threading.Lock()
        self._gloo: ProcessGroupGloo | None = None
        self._destroyed = False
        self._pending: list[tuple[FakeWork, object]] = []
        self._queue: list[tuple[FakeWork, object]] = []
        self._has_work = threading.Condition(self._lock)
        self._stopped = False
        fake.record("ProcessGroupHCCL", rank, size, options.group_id, options._timeout)
        threading.Thread(target=self._progress, name=f"hccl-progress-{rank}", daemon=True).start()
        threading.Thread(target=self._watchdog, name=f"hccl-watchdog-{rank}", daemon=True).start()

    def _set_sequence_number_for_group(self) -> None:
        self.fake.record("_set_sequence_number_for_group", self.rank)

    def abort(self) -> None:  # c10d::Backend::abort(): a no-op
        self.fake.record("pg.abort")

    def _get_stream_id(self, p2p: bool = False, peer: int = -1) -> int:
        return -1 if self.hccl_stream is None else self.hccl_stream.stream_id

    def abort_hccl_comm(self, reason=None) -> None:
        self.fake.record("abort_hccl_comm", self.rank, reason)
        with self._lock:
            if self._destroyed:  # abortAndClearHcclComm cleared devHCCLCommMap_: nothing to destroy
                return
            self._destroyed = True
            running = [w for w, _ in self._pending if not w.is_completed()]
            gloo = None if running else self._gloo
            if not running:
                self._gloo = None
            self._has_work.notify_all()
        if self.hccl_stream is not None:
            self.fake.record("HcclCommDestroy", self.rank, HCCL_E_AGAIN if running else HCCL_SUCCESS)
        if running:  # destroy returned HCCL_E_AGAIN, ignored: the operation runs on, holding its stream
            self.fake.stuck.hold(self.hccl_stream.device_index, self.hccl_stream.stream_id, self.fake.exec_timeout_s)
            timer = threading.Timer(self.fake.exec_timeout_s, self._exec_timeout, args=(running,))
            timer.daemon = True
            timer.start()
        if gloo is not None:  # stop the transport under it (its pending ops fail, ignored below)
            with contextlib.suppress(Exception):
                gloo.recv([torch.zeros(1, dtype=torch.uint8)], 1 - self.rank, 0x7E9E).wait(timedelta(milliseconds=1))

    def send(self, tensors, dst_rank: int, tag: int = 0) -> FakeWork:
        return self._post("send", tensors, dst_rank, tag)

    def recv(self, tensors, src_rank: int, tag: int = 0) -> FakeWork:
        return self._post("recv", tensors, src_rank, tag)

    def recv_anysource(self, *args):
        raise RuntimeError("HCCL does not support recv from any source")

    # ------------------------------------------------------------------ internals
    def _exec_timeout(self, works) -> None:
        for work in works:
            if not work.is_completed():
                work.error = RuntimeError(f"[Rank {self.rank}] device task exception: {work.op} past HCCL_EXEC_TIMEOUT")

    def _comm(self) -> ProcessGroupGloo:
        with self._lock:
            if self._destroyed:
                raise RuntimeError("HCCL communicator has been destroyed (abort_hccl_comm)")
            if self._gloo is not None:
                return self._gloo
        # The blocking rendezvous of HcclCommInitRootInfo, in the calling thread.
        self.fake.record("comm_init", self.rank, self.fake.current_device())
        device = self.fake.current_device()
        if self.fake.current_stream().stream_id >> 5 == SYNCLAUNCH:
            stream = self.fake.pool.from_sync_launch_pool(device)
        else:
            stream = self.fake.pool.from_pool(device, -1 if os.environ.get("TORCH_HCCL_HIGH_PRIORITY", "0") == "1" else 0)
        gloo = ProcessGroupGloo(PrefixStore("fake-hccl-comm", self.store), self.rank, self.size, self.options._timeout)
        with self._lock:
            self._gloo = self._gloo or gloo
            self.hccl_stream = self.hccl_stream or stream
            return self._gloo

    def _post(self, op: str, tensors, peer: int, tag: int) -> FakeWork:
        (t,) = tensors  # a CPU tensor here: pointToPoint's SetDevice(tensor's device) has no index to set
        gloo = self._comm()
        work = FakeWork(self, op, t.numel())
        self.fake.record(op, self.rank, peer, tag, t.dtype, t.numel(), self.fake.current_stream().stream_id)
        inner = getattr(gloo, op)([t], peer, tag)
        with self._lock:
            self._queue.append((work, inner))
            self._pending.append((work, inner))
            self._has_work.notify_all()
        return work

    def _progress(self) -> None:
        """The device executing the HCCL stream: works finish in posting order."""
        while True:
            with self._lock:
                while not self._queue and not self._stopped and not self._destroyed:
                    self._has_work.wait(0.5)
                if self._destroyed or self._stopped:
                    return
                work, inner = self._queue.pop(0)
            try:
                inner.wait()
            except Exception:  # a dead peer or a destroyed comm: HCCL reports nothing (see above)
                return
            # queued on its HCCL stream behind another group's stuck task, if there is one
            self.fake.stuck.wait_free(self.hccl_stream.device_index, self.hccl_stream.stream_id, lambda: self._destroyed)
            work.done.set()

    def _watchdog(self) -> None:
        timeout_s = self.options._timeout.total_seconds()
        while not (self._destroyed and not self._pending):
            time.sleep(WATCHDOG_PERIOD_S)
            with self._lock:
                self._pending = [(w, i) for w, i in self._pending if not w.is_completed()]
                overdue = [w for w, _ in self._pending if time.monotonic() - w.start >= timeout_s]
            for work in overdue:
                work.error = RuntimeError(f"[Rank {self.rank}] Watchdog caught collective operation timeout: "
                                          f"{work.op} ran for {int((time.monotonic() - work.start) * 1000)} "
                                          f"milliseconds before timing out.")
                self.fake.record("watchdog_timeout", self.rank, work.op)
                if self.error_handling in _TEAR_DOWN_MODES:
                    print("To avoid data inconsistency, we are taking the entire process down.", file=sys.stderr, flush=True)
                    os.abort()
