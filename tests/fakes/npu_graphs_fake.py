"""NPU graphs for the fake torch_npu: `torch.npu.NPUGraph` capture / replay, `torch.npu.graph`,
`graph_pool_handle`, `ExternalEvent`, and the graph-task group / update calls, with the semantics
their sources give them (torch_npu/npu/graphs.py and streams.py, read from the 2.8.0, 2.9.0 and
2.12.0 wheels; the functions are the same on all three). Tests only.

What is modelled, and from where:
- capture (`NPUGraph.capture_begin` / `capture_end`, entered by `graph.__enter__` after
  `synchronize()` and `empty_cache()`, on the context's capture stream): the device work the
  capturing thread issues on that stream becomes the graph's tasks, in order. Every task keeps the
  tensors it was given (a graph replays on the same addresses) and the HOST arguments it was
  launched with, by value: a kernel's tiling is done on the host at launch (FIA's from its
  actual_seq_lengths lists), so a replay reruns it with the capture's lists. Here a task is an
  aten operator (seen through a TorchDispatchMode) or one of the fake's kernels; each runs once at
  capture too (real capture does not run it; nothing reads a captured output before a replay),
  and each replay reruns it, refilling the outputs it recorded. A host read inside a capture
  (`item()`) fails, as an unpermitted call on a capturing stream does, and invalidates the capture:
  `capture_end` then raises (as CUDA's cudaStreamEndCapture does; assumed, not read, for ACL);
- `graph_task_group_begin(stream)` / `graph_task_group_end(stream) -> handle`: the kernels
  captured between them form one task group, named by the handle;
- `graph_task_update_begin(stream, handle)` / `graph_task_update_end(stream)`: the kernels the
  thread launches on `stream` between them are not run: they replace, one for one and in order,
  the parameters of the group's tasks (host lists included), for every later replay — until the
  next update. A replay after no update reruns the last parameters (stale lengths);
- `ExternalEvent` (streams.py: "you can call wait() before record()", "before reusing
  ExternalEvent, you need to call reset()"): a wait captured into a graph holds the replay until
  the event is recorded; here a replay that reaches such a wait with the event unrecorded raises
  `GraphReplayHang` — on the device that replay never finishes. `reset` captured clears it.
"""
from __future__ import annotations

import contextlib

import torch
from torch.utils._python_dispatch import TorchDispatchMode


class GraphReplayHang(RuntimeError):
    """A replay waited on an ExternalEvent that nothing recorded: the device would hang there."""


def _stream_key(stream) -> tuple[int, int]:
    return stream.device_index, stream.stream_id


def _by_value(bound: dict) -> dict:
    """A launch's arguments as a captured task keeps them: host lists copied, tensors by reference."""
    return {k: list(v) if isinstance(v, (list, tuple)) and not any(isinstance(x, torch.Tensor) for x in v) else v
            for k, v in bound.items()}


def _refill(recorded, fresh) -> None:
    if isinstance(recorded, torch.Tensor) and isinstance(fresh, torch.Tensor):
        if fresh is not recorded:
            recorded.copy_(fresh)
    elif isinstance(recorded, (tuple, list)) and isinstance(fresh, (tuple, list)):
        for r, f in zip(recorded, fresh):
            _refill(r, f)


class KernelTask:
    def __init__(self, name: str, impl, bound: dict, out):
        self.name, self.impl, self.bound, self.out = name, impl, _by_value(bound), out

    def run(self) -> None:
        _refill(self.out, self.impl(self.bound))


class AtenTask:
    def __init__(self, func, args, kwargs, out):
        self.func, self.args, self.kwargs, self.out = func, args, kwargs, out

    def run(self) -> None:
        _refill(self.out, self.func(*self.args, **self.kwargs))


class CallTask:
    def __init__(self, fn):
        self.run = fn


class Tape:
    """One graph's tasks, in capture order."""

    def __init__(self):
        self.tasks: list = []
        self.group: list[KernelTask] | None = None  # open task group
        self.recording = True
        self.invalidated = False  # an unpermitted call was made: capture_end fails

    @contextlib.contextmanager
    def paused(self):
        self.recording = False
        try:
            yield
        finally:
            self.recording = True

    def kernel(self, name: str, impl, bound: dict):
        with self.paused():  # one device task: the kernel's own torch calls are not tasks
            out = impl(bound)
        task = KernelTask(name, impl, bound, out)
        self.tasks.append(task)
        if self.group is not None:
            self.group.append(task)
        return out

    def replay(self) -> None:
        with self.paused():
            for task in self.tasks:
                task.run()


class _CaptureMode(TorchDispatchMode):
    def __init__(self, tape: Tape):
        super().__init__()
        self.tape = tape

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if not self.tape.recording:
            return func(*args, **kwargs)
        if func is torch.ops.aten._local_scalar_dense.default:
            self.tape.invalidated = True
            raise RuntimeError("operation not permitted when stream is capturing (a host read in an NPU graph)")
        out = func(*args, **kwargs)
        self.tape.tasks.append(AtenTask(func, args, kwargs, out))
        return out


class TaskGroupHandle:
    """`torch_npu._C._NPUTaskGroupHandle`: the tasks of one group."""

    def __init__(self, tasks: list[KernelTask]):
        self.tasks = tasks


class _Update:
    def __init__(self, handle: TaskGroupHandle):
        self.handle, self.done = handle, 0

    def reissue(self, name: str, bound: dict):
        if self.done >= len(self.handle.tasks):
            raise RuntimeError("graph task update: more launches than the group has tasks")
        task = self.handle.tasks[self.done]
        if task.name != name:
            raise RuntimeError(f"graph task update: {name} re-issued for a captured {task.name}")
        task.bound = _by_value(bound)
        self.done += 1
        return task.out


class FakeNpuGraphs:
    """The graph state of one fake torch_npu: which stream captures into which tape, which
    stream updates which task group. `launch` is every fake kernel's way onto the device."""

    def __init__(self, fake):
        self.fake = fake
        self.capturing: dict[tuple[int, int], Tape] = {}
        self.updating: dict[tuple[int, int], _Update] = {}
        self.replays = 0

    def tape(self, stream) -> Tape | None:
        return self.capturing.get(_stream_key(stream if stream is not None else self.fake.current_stream()))

    def launch(self, name: str, impl, bound: dict):
        key = _stream_key(self.fake.current_stream())
        if key in self.updating:
            return self.updating[key].reissue(name, bound)
        tape = self.capturing.get(key)
        return impl(bound) if tape is None else tape.kernel(name, impl, bound)

    # torch_npu/npu/graphs.py module functions
    def graph_pool_handle(self):
        return object()

    def graph_task_group_begin(self, stream) -> None:
        tape = self.tape(stream)
        if tape is None or tape.group is not None:
            raise RuntimeError("graph_task_group_begin: the stream is not capturing, or a group is open")
        tape.group = []

    def graph_task_group_end(self, stream) -> TaskGroupHandle:
        tape = self.tape(stream)
        if tape is None or tape.group is None:
            raise RuntimeError("graph_task_group_end without graph_task_group_begin")
        handle, tape.group = TaskGroupHandle(tape.group), None
        return handle

    def graph_task_update_begin(self, stream, handle: TaskGroupHandle) -> None:
        self.updating[_stream_key(stream)] = _Update(handle)

    def graph_task_update_end(self, stream) -> None:
        update = self.updating.pop(_stream_key(stream))
        if update.done != len(update.handle.tasks):
            raise RuntimeError(f"graph task update: {update.done} of the group's {len(update.handle.tasks)} tasks")

    def build(self, npu, names: set[str] | None = None) -> None:
        """Put the graph API on the fake's `torch_npu.npu`: the `names` a line exports (None: all;
        Stream and empty_cache are the fake's own either way)."""
        graphs = self

        class NPUGraph:
            def __init__(self):
                self._tape: Tape | None = None
                self._mode: _CaptureMode | None = None
                self._stream = None

            def capture_begin(self, pool=None, capture_error_mode="global"):
                self._stream = _stream_key(graphs.fake.current_stream())
                self._tape = graphs.capturing[self._stream] = Tape()
                self._mode = _CaptureMode(self._tape)
                self._mode.__enter__()

            def capture_end(self):
                self._mode.__exit__(None, None, None)
                del graphs.capturing[self._stream]
                if self._tape.invalidated:
                    raise RuntimeError("capture_end: the capture was invalidated by an unpermitted call")
                if self._tape.group is not None:
                    raise RuntimeError("capture ended inside an open task group")

            def replay(self):
                graphs.replays += 1
                self._tape.replay()

            def reset(self):
                self._tape = None

        class graph:  # torch_npu/npu/graphs.py `graph`
            default_capture_stream = None

            def __init__(self, npu_graph, pool=None, stream=None, auto_dispatch_capture=False,
                         capture_error_mode="global"):
                if graph.default_capture_stream is None:
                    graph.default_capture_stream = npu.Stream()
                self.stream_ctx = npu.stream(stream if stream is not None else graph.default_capture_stream)
                self.npu_graph, self.pool = npu_graph, pool

            def __enter__(self):
                npu.synchronize()
                npu.empty_cache()
                self.stream_ctx.__enter__()
                self.npu_graph.capture_begin(self.pool)

            def __exit__(self, *exc):  # as graphs.py: a capture_end that raises leaves the stream set
                self.npu_graph.capture_end()
                self.stream_ctx.__exit__(*exc)

        class ExternalEvent:
            def __init__(self):
                self.recorded = False

            def _set(self, value: bool) -> None:
                self.recorded = value

            def _await(self) -> None:
                if not self.recorded:
                    raise GraphReplayHang("the graph waits on an ExternalEvent nothing recorded (no task update "
                                          "before this replay): on the device the replay never finishes")

            def _issue(self, stream, fn) -> None:
                tape = graphs.tape(stream)
                if tape is not None:
                    tape.tasks.append(CallTask(fn))
                else:
                    fn()

            def record(self, stream=None):
                self._issue(stream, lambda: self._set(True))

            def wait(self, stream=None):
                tape = graphs.tape(stream)
                if tape is not None:
                    tape.tasks.append(CallTask(self._await))

            def reset(self, stream=None):
                self._issue(stream, lambda: self._set(False))

        npu.empty_cache = lambda: None
        api = {"NPUGraph": NPUGraph, "graph": graph, "ExternalEvent": ExternalEvent,
               "graph_pool_handle": self.graph_pool_handle}
        for name in ("graph_task_group_begin", "graph_task_group_end", "graph_task_update_begin",
                     "graph_task_update_end"):
            api[name] = getattr(self, name)
        for name, value in api.items():
            if names is None or name in names:
                setattr(npu, name, value)


def fia_out(fia):
    """`npu_fused_infer_attention_score.out` from the stand-in's FIA: the same computation written into
    `attention_out` (and a [1] `softmax_lse` when softmax_lse_flag is off); a workspace, when given,
    must be at least `_npu_fused_infer_attention_score_get_max_workspace`'s for these shapes."""
    def impl(a):
        ws = a["workspace"]
        if ws is not None and ws.numel() * ws.element_size() < max_workspace_bytes(a):
            raise RuntimeError("FIA: workspace smaller than its max workspace")
        out, _ = fia({k: v for k, v in a.items() if k not in ("workspace", "attention_out", "softmax_lse")})
        a["attention_out"].copy_(out)
        return a["attention_out"], a["softmax_lse"]
    return impl


def max_workspace_bytes(a: dict) -> int:
    """The stand-in's GetMaxWorkspaceSize: a function of the shapes (never of the host lengths)."""
    q = a["query"]
    return 4096 + 4 * q.numel() + 64 * a["block_table"].numel()


def get_max_workspace(a: dict) -> torch.Tensor:
    return torch.empty(max_workspace_bytes(a), dtype=torch.uint8, device=a["query"].device)
