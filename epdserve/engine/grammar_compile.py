"""Grammar compiles off the engine loop: a request whose structured output is not compiled yet
waits while a small thread pool (the engine's own) compiles it; every other request goes on.

- `GrammarCompiles(backend, workers)`: one per engine, around its `GrammarBackend` (the cache).
  `start(c, replay)` returns the request's `GrammarState` at once: ready when the grammar is in
  the cache (a hit is synchronous, no thread involved), else pending (`state.ready` False, no
  matcher yet) while a worker compiles it. The scheduler does not schedule a request whose
  grammar is pending (admission and decodes skip it), so no token is sampled without its mask.
  The same new constraint asked for by several requests is compiled once (they share the
  compile in flight). A constraint that `check` refuses still raises InvalidRequestError at
  `start` (the request is refused at add, as before).
- Two lanes, each with its own worker(s) and compile process: constraints up to
  `SMALL_SPEC_BYTES` of text, and larger ones, so that a small schema never waits behind a big
  one's compile (seconds) — a small constraint that still compiles slowly is cut by the time budget.
- Within a lane compiles queue per tenant (`start(..., tenant=)`): a free worker takes the next compile of the
  tenant it served least recently, so one tenant's backlog of big schemas never sits ahead of
  another's new one; within a tenant, arrival order. A queued compile whose requests are all gone
  (aborted) is dropped before it starts; one already running goes on into the cache.
- `poll()` (the engine, at the start of each step, on its own thread): the compiles that ended.
  A compiled grammar joins the cache and each of its waiting states gets its matcher (a resumed
  attempt's tokens replayed); returns the states whose compile or replay failed, with the
  reason (the engine fails those requests alone, not retryable).
- With a time budget (`timeout_s` > 0, `--grammar-compile-timeout-s`) a worker hands each compile to
  the engine's compile process (engine/grammar_process.py) and waits at most that long: a compile
  over it fails its requests alone (InvalidRequestError naming the flag, never cached) and its
  process is killed — CPU and memory with it — so a hostile schema costs the engine one budget,
  not minutes. `timeout_s` 0: compiles run on the worker thread itself, unbounded.
- `pending`: compiles in flight (the worker polls the engine soon, as for KV transfers);
  `close()`: the pool shut down (also when the engine is collected).
Most of xgrammar's compile runs without the GIL, not all of it (benchmarks/structured_outputs.py's
`compile` part: during a ~125 ms compile of a 400-field schema the engine thread's longest stall
was ~30 ms; docs/openai.md), so a compile costs the loop a fraction of its time, not all of it.
The cache and the matchers are touched only on the engine's thread; workers only compile.
"""
from __future__ import annotations

import threading
import weakref
from collections import deque
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Callable

from epdserve.engine.grammar import GrammarBackend, GrammarState, check
from epdserve.engine.grammar_process import CompileProcess
from epdserve.engine.structured_output import StructuredOutput
from epdserve.engine.turns import Turns
from epdserve.request_errors import InvalidRequestError


SMALL_SPEC_BYTES = 8192  # a constraint's text up to this compiles in the small lane
LANES = ("small", "large")


def lane(c: StructuredOutput) -> str:
    return "small" if len(c.spec.encode()) <= SMALL_SPEC_BYTES else "large"


@dataclass
class _Compile:
    """One constraint's compile: queued (no future yet) or running, and the states waiting for it."""

    constraint: StructuredOutput
    lane: str
    tenant: str
    future: Future | None = None
    waiting: list[tuple[GrammarState, tuple]] = field(default_factory=list)  # (state, its replay)

    @property
    def running(self) -> bool:
        return self.future is not None and not self.future.done()


class GrammarCompiles:
    """One engine's compiles in flight (see the module docstring)."""

    def __init__(self, backend: GrammarBackend, workers: int = 1, timeout_s: float = 0.0):
        self.backend = backend
        self.workers = workers  # per lane
        self.timeout_s = timeout_s
        self.processes: dict[str, CompileProcess] = {}  # lane -> its compile process (with a time budget)
        # a test seam: called on the worker before each compile (a test blocks it to hold a compile)
        self.before_compile: Callable[[StructuredOutput], None] | None = None
        self._pool: ThreadPoolExecutor | None = None
        self._finalizer = None
        self._lock = threading.Lock()  # the compiler's first build (its TokenizerInfo) happens on a worker
        self._inflight: dict[tuple, _Compile] = {}  # cache key -> its compile
        self._queued: dict[str, dict[str, deque[tuple]]] = {ln: {} for ln in LANES}  # lane -> tenant -> cache keys
        self._turns = {ln: Turns() for ln in LANES}  # lane -> tenants by when a worker last took one of theirs

    @property
    def pending(self) -> bool:
        return bool(self._inflight)

    def start(self, c: StructuredOutput, replay=(), tenant: str = "") -> GrammarState:
        """The request's grammar state: ready (a cached grammar, the replay applied:
        InvalidRequestError when the grammar refuses it) or pending (queued under `tenant`, or
        compiling)."""
        compiled = self.backend.cached(c)
        if compiled is not None:
            return self.backend.state(compiled, c, replay)
        key = self.backend.key(c)
        if key not in self._inflight:
            check(c)  # a constraint that cannot parse is refused now, at add
            job = self._inflight[key] = _Compile(c, lane(c), tenant)
            self._queued[job.lane].setdefault(tenant, deque()).append(key)
        state = GrammarState(None)
        self._inflight[key].waiting.append((state, tuple(replay)))
        self._pump()
        return state

    def _pump(self) -> None:
        """Hand queued compiles to free workers, in each lane the least recently served tenant's first."""
        for ln, queued in self._queued.items():
            running = sum(1 for job in self._inflight.values() if job.lane == ln and job.running)
            while running < self.workers and queued:
                tenant = self._turns[ln].next(queued)
                key = queued[tenant].popleft()
                if not queued[tenant]:
                    del queued[tenant]
                self._turns[ln].served(tenant)
                job = self._inflight[key]
                job.future = self._executor().submit(self._compile, job.constraint)
                running += 1

    def poll(self) -> list[tuple[GrammarState, str]]:
        """Finish the compiles that ended (see the module docstring); the failed states and why."""
        failed: list[tuple[GrammarState, str]] = []
        for key in [k for k, job in self._inflight.items() if job.future is not None and job.future.done()]:
            job = self._inflight.pop(key)
            c = job.constraint
            try:
                compiled = self.backend.add(c, job.future.result())
            except Exception as e:  # InvalidRequestError: xgrammar refused it; anything else: its bug
                why = str(e) if isinstance(e, InvalidRequestError) else f"the structured output failed to compile: {e!r}"
                failed.extend((state, why) for state, _ in job.waiting)
                continue
            for state, replay in job.waiting:
                try:
                    state.attach(self.backend.state(compiled, c, replay).matcher)
                except InvalidRequestError as e:
                    failed.append((state, str(e)))
        self._pump()
        return failed

    def discard(self, state: GrammarState) -> None:
        """A request that waited is gone (aborted): its state is no longer set. A compile already
        running goes on into the cache; a queued one nobody waits for any more is dropped."""
        for key, job in list(self._inflight.items()):
            job.waiting[:] = [w for w in job.waiting if w[0] is not state]
            if job.future is None and not job.waiting:
                del self._inflight[key]
                queue = self._queued[job.lane][job.tenant]
                queue.remove(key)
                if not queue:
                    del self._queued[job.lane][job.tenant]

    def close(self) -> None:
        if self._finalizer is not None:
            self._finalizer()
        for proc in self.processes.values():
            proc.close()

    def _executor(self) -> ThreadPoolExecutor:
        if self._pool is None:
            self._pool = ThreadPoolExecutor(self.workers * len(LANES), thread_name_prefix="grammar-compile")
            self._finalizer = weakref.finalize(self, self._pool.shutdown, wait=False, cancel_futures=True)
        return self._pool

    def _compile(self, c: StructuredOutput):
        if self.before_compile is not None:
            self.before_compile(c)
        with self._lock:
            self.backend.prepare()
            if self.timeout_s > 0 and lane(c) not in self.processes:
                self.processes[lane(c)] = CompileProcess(self.backend.info_json())
        if self.timeout_s <= 0:
            return self.backend.compile_uncached(c)
        return self.backend.deserialize(self.processes[lane(c)].compile(c, self.timeout_s))
