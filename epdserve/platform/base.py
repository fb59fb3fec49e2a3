"""The `Platform` contract: one device family's device handle, dist backend and pair groups, streams, core limits."""
from __future__ import annotations

import contextlib
import logging
import os
import time
from abc import ABC, abstractmethod

import torch

log = logging.getLogger(__name__)


def capture_body(context, fn, leave):
    """`fn()` run inside `context` (a graph capture: torch.cuda.graph, torch.npu.graph). A failure
    calls `leave()` (set back what the context's exit could not: the thread's stream, the
    allocator) and raises the body's own exception with its traceback — not the complaint the
    context's exit (`capture_end`) makes about the capture it invalidated."""
    body_error: list[BaseException] = []
    try:
        with context:
            try:
                return fn()
            except BaseException as e:
                body_error.append(e)
                raise
    except BaseException as e:
        leave()
        if body_error and body_error[0] is not e:
            raise body_error[0] from None
        raise


class Platform(ABC):
    """What the rest of epdserve may ask of a device family.

    name: "cpu" | "cuda" | "npu"; dist_backend: the torch.distributed backend for KV transfer;
    visible_devices_env: the env var that restricts which devices a process sees;
    kv_block_size: the paged-KV block size (tokens) this device's attention kernels want.
    """

    name: str
    dist_backend: str
    visible_devices_env: str | None
    kv_block_size: int = 16

    @abstractmethod
    def is_available(self) -> bool: ...

    def unavailable_reason(self) -> str | None:
        """Why this platform cannot be used here, in one line (None when it can)."""
        return None if self.is_available() else f"no {self.name} device is available"

    def device(self, index: int | None = None) -> torch.device:
        return torch.device(self.name if index is None else f"{self.name}:{index}")

    def set_thread_device(self, index: int = 0) -> None:
        """Select device `index` for the calling thread: torch_npu (and CUDA) keep the current
        device per thread, so every thread that touches the device calls this first."""
        getattr(torch, self.name).set_device(index)

    def device_count(self) -> int:
        """Accelerators this process can see (torch.cuda / torch.npu device_count)."""
        return int(getattr(torch, self.name).device_count())

    def synchronize(self) -> None:
        """Wait for queued device work (no-op on CPU)."""

    def record_event(self):
        """An event recorded on the current stream now (its `synchronize()` waits for the work
        queued before it); None on the CPU, where work is done when the call returns."""
        event = getattr(torch, self.name).Event()
        event.record()
        return event

    # Graph capture of decode steps (engine/graph_runner.py). Where `has_graphs` is False every
    # step runs eagerly; the two methods below are called only where it is True.
    has_graphs: bool = False

    def graphs_unavailable_reason(self) -> str | None:
        """Why this platform decodes eagerly, in one line (None: it has graphs)."""
        return None if self.has_graphs else f"the platform has no graphs ({self.name} decodes eagerly)"

    def graph_pool(self):
        """A memory-pool handle the captured graphs share."""
        raise NotImplementedError(f"{self.name} has no graph capture")

    def capture_graph(self, fn, pool):
        """Capture the device work of `fn()` into a graph: (graph, fn's output tensor). Each
        `graph.replay()` reruns that work on whatever its input buffers then hold, rewriting the
        output tensor in place."""
        raise NotImplementedError(f"{self.name} has no graph capture")

    def spare_memory_bytes(self, index: int = 0) -> int | None:
        """Device memory this process could still allocate on device `index`: the runtime's free
        memory (torch.cuda / torch.npu `mem_get_info`, where this process's cached blocks count as
        used) plus what its caching allocator holds unallocated; None where not known (CPU)."""
        mod = getattr(torch, self.name)
        free, _ = mod.mem_get_info(index)
        return int(free + mod.memory_reserved(index) - mod.memory_allocated(index))

    def new_stream(self, priority: int = 0):
        """A stream for one stage worker or pair (lower `priority` = higher where the device has
        stream priorities: CUDA; NPU has none), or None where streams do not exist (CPU)."""
        return None

    def release_stream(self, stream) -> None:
        """Its holder is done with `stream` (from `new_stream`); a later one may reuse it."""

    def pair_stream_conflict(self, pg, peer_rank: int) -> str | None:
        """Why the backend's stream for this pair group is one of ours (None: it is not, or unknown)."""
        return None

    def stream_context(self, stream):
        return contextlib.nullcontext()

    def set_thread_stream(self, stream) -> None:
        """Make `stream` the calling thread's current stream (torch keeps it per thread)."""
        getattr(torch, self.name).set_stream(stream)

    def limit_stream(self, stream, cube: int, vector: int) -> bool:
        """Restrict a stream to a share of the device's compute units; False if unsupported."""
        return False

    def stuck_work_bound_s(self) -> float | None:
        """After a pair group's teardown, how long a receive that did not end may still write into
        its buffer (None: teardown ends it, or its drain did: no bound to wait out)."""
        return None

    def limit_device(self, index: int, cube: int, vector: int) -> bool:
        """Restrict this whole process to `cube` / `vector` compute units of device `index`, once,
        before its first operator; False if unsupported."""
        return False

    # Env the backend reads when a group is built: its watchdog must not take the process down
    # when one pair fails (a stalled or dead peer fails that pair's transfers only).
    pair_group_env: tuple[tuple[str, str], ...] = ()
    # A tensor-parallel group wants the opposite: its watchdog ends the process when a collective
    # fails or outlives the group's timeout (a rank that died or hangs), so the instance is
    # restarted whole (engine/tp/group.py). A disaggregated P or D instance at TP > 1 holds both
    # kinds in one process (its TP group, then its KV pairs): each group is built under its own
    # value where the backend reads it per group (NCCL: ProcessGroupNCCL's constructor); where it
    # reads it once per process (HCCL), the first group's — the TP group's — holds for all of them.
    tp_group_env: tuple[tuple[str, str], ...] = ()
    reads_group_env_once = False  # the backend reads the variables at its first group only (HCCL)

    def prepare_pair_groups(self, tensor_parallel: bool = False) -> None:
        """Set `pair_group_env` (`tp_group_env` for a tensor-parallel group) before a group is
        built: a value the operator set is kept (with a warning when it differs), one epdserve set
        for an earlier group is replaced."""
        ours = self.__dict__.setdefault("_group_env_set", {})  # name -> the value epdserve last set
        for name, value in self.tp_group_env if tensor_parallel else self.pair_group_env:
            current = os.environ.get(name)
            if current is None or ours.get(name) == current:
                if current is not None and current != value and self.reads_group_env_once and not tensor_parallel:
                    log.warning("%s=%s holds for this process (%s reads it at the first group, here the "
                                "tensor-parallel one): a KV pair that fails ends the instance, which its "
                                "supervisor restarts while the scheduler retries its requests", name, current,
                                self.dist_backend)
                    continue
                os.environ[name] = ours[name] = value
            elif current != value:
                what = "not end this process when a tensor-parallel collective fails" if tensor_parallel else \
                    "take this process down when one KV pair times out"
                log.warning("%s=%s is set: the %s watchdog may %s (epdserve would use %s)", name, current,
                            self.dist_backend, what, value)

    def make_pair_group(self, store, rank: int, world_size: int, timeout, group_name: str = "",
                        host: str | None = None, tensor_parallel: bool = False):
        """Build a process group over `store` without a global world (stateless group).
        `tensor_parallel`: the group of a TP instance's ranks (its watchdog env: `tp_group_env`).

        `group_name` identifies the group where the backend needs it (HCCL's group_id). `host`:
        the local address its sockets bind where the backend takes one per group (gloo); NCCL
        and HCCL take theirs from the environment (NCCL_SOCKET_IFNAME, HCCL_IF_IP: see
        transfer/kv/README.md)."""
        raise NotImplementedError(f"{self.name}: pairwise groups not implemented")

    interrupts_per_peer = False  # does `interrupt_pair_group` break only the link to `peer_rank`?

    def interrupt_pair_group(self, pg, peer_rank: int) -> None:
        """Break `pg` (from `make_pair_group`) so every wait blocked on it wakes with an error.

        Called by a pair being torn down (peer died, stalled, or closed by us); the group is
        never used again. Must not raise. Default: the backend's `abort()` (NCCL)."""
        abort = getattr(pg, "abort", None)
        if abort is not None:
            abort()

    def wait_work(self, work, timeout_s: float) -> None:
        """Return once `work` (a send/recv of a pair group) has completed on the device; raise
        TimeoutError after `timeout_s`, RuntimeError when the backend reports its failure.

        NCCL / HCCL: `Work.wait()` does not block the host (it makes the calling thread's
        current stream wait on the work's end event and returns True; torch_npu's
        WorkHCCL::wait / synchronizeInternal unless TORCH_HCCL_BLOCKING_WAIT=1), so the
        deadline is ours: poll `is_completed()` (true once the end event has fired, or on an
        error), never `wait()`, so no stream of ours is chained to the peer."""
        deadline = time.monotonic() + timeout_s
        pause = 5e-5
        while not work.is_completed():
            if time.monotonic() >= deadline:
                raise TimeoutError(f"Timed out after {timeout_s:g} s: the peer did not complete the message")
            time.sleep(pause)
            pause = min(pause * 2, 2e-3)
        error = work.exception()
        if error is not None:
            raise RuntimeError(f"the {self.dist_backend} operation failed: {error}")
