"""Discrete-event simulation of one deployment serving one workload → per-request records.

Time is simulated seconds; stage costs come from the `CostModel` in ms. The pieces:
- a request arrives at its offset, spends the scheduler's preprocessing time (JPEG decode + image
  processor, per image), is routed (least outstanding work, as `scheduler/routing.py`), then:
  E (each media item to an E worker) → features E→P (link time) → P → first token → KV P→D (link
  time) → D; a coupled worker (PD, EPD) takes the whole request, EPD encoding its own media,
  P+E encoding inline. Text-only requests skip E.
- `Device`: one step at a time (non-preemptive). When it frees up it runs, in order: a decode
  step that is due — its batch has waited at least `tpot_pace - step time` since its last step,
  so tokens keep the TPOT pace; else the oldest queued encode/prefill work (FIFO over its
  workers); else any decode step (work-conserving). A worker alone on its device simply runs
  back to back. Coupled workers count as decoding when they have a decode batch.
- transfers and preprocessing are delays, not shared resources; KV cache capacity, the
  scheduler's own CPU time and the client's network are not modelled.

An instance of tensor-parallel degree d steps at the costs of a profile measured at d (`costs` per
degree); with one profile every instance runs at its speed.

`simulate(deployment, costs, shapes)` returns `perf.serving_metrics.RequestRecord`s (token times as
the client would see them), so every figure comes from the benchmarks' own metric functions.
"""
from __future__ import annotations

import heapq
import itertools
from collections.abc import Mapping

from epdserve.perf.serving_metrics import RequestRecord
from epdserve.planner.costs import CostModel
from epdserve.planner.deployment import PlannedDeployment
from epdserve.planner.shapes import RequestShape
from epdserve.planner.workers import (Job, Limits, SimCoupledWorker, SimDecodeWorker, SimEncodeWorker, SimPrefillWorker,
                                      Worker)
from epdserve.roles import role_set

MAX_EVENTS_PER_REQUEST = 200_000


class SimulationError(RuntimeError):
    """The simulation could not finish every request (a planner bug, never a workload's fault)."""


class Device:
    """One NPU / GPU / core group: runs one step of one of its workers at a time, to its end."""

    def __init__(self, sim, index: int):
        self.sim, self.index = sim, index
        self.workers: list[Worker] = []
        self.busy = False
        self.busy_s = 0.0

    def choose(self, now: float) -> Worker | None:
        """A due decode step, else the oldest queued encode/prefill work, else any decode step."""
        pace = self.sim.tpot_pace_s
        decoding = [w for w in self.workers if w.decoding()]
        due = [w for w in decoding
               if now >= w.last_decode_end + max(0.0, pace - w.costs.decode_ms(w.decode_batch_size()) / 1e3) - 1e-12]
        if due:
            return min(due, key=lambda w: w.last_decode_end)
        waiting = [(w.fifo_head(), i) for i, w in enumerate(self.workers) if w.fifo_head() is not None]
        if waiting:
            return self.workers[min(waiting)[1]]
        return min(decoding, key=lambda w: w.last_decode_end) if decoding else None

    def kick(self, now: float) -> None:
        if self.busy:
            return
        worker = self.choose(now)
        if worker is None:
            return
        ms, done = worker.step(now)
        self.busy = True
        self.busy_s += ms / 1e3

        def end(t: float) -> None:
            self.busy = False
            done(t)
            self.kick(t)
        self.sim.at(now + ms / 1e3, end)


class Simulation:
    def __init__(self, deployment: PlannedDeployment, costs: CostModel | Mapping[int, CostModel],
                 tpot_pace_s: float = 0.1, limits: Limits | None = None):
        """`costs`: one model for every instance, or one per tensor-parallel degree ({degree: model},
        each from a profile measured at that degree): an instance steps at its degree's costs;
        preprocessing and transfers take the lowest degree's."""
        degrees = deployment.instance_degrees()
        per_degree = dict(costs) if isinstance(costs, Mapping) else {d: costs for d in degrees}
        missing = sorted(set(degrees) - set(per_degree))
        if missing:
            raise ValueError(f"no profile at tensor_parallel_size {', '.join(map(str, missing))} (profiles at "
                             f"{', '.join(map(str, sorted(per_degree)))}): measure one with `epdserve profile "
                             f"--model DIR --tensor-parallel-size {missing[0]}`")
        costs = per_degree[min(per_degree)]
        self.deployment, self.costs, self.tpot_pace_s = deployment, costs, tpot_pace_s
        self.limits = limits or Limits()
        self.now = 0.0
        self._events: list = []
        self._seq = itertools.count()
        self.devices: dict[int, Device] = {}
        self.encoders: list[Worker] = []
        self.prefillers: list[Worker] = []
        self.decoders: list[Worker] = []
        self.coupled: list[SimCoupledWorker] = []
        for i, (roles, degree) in enumerate(zip(deployment.instance_roles(), degrees)):
            dev = self.devices.setdefault(deployment.device_of(i), Device(self, deployment.device_of(i)))
            for w in self._workers(roles, dev, f"{roles}{i}"):
                w.costs = per_degree[degree]
                dev.workers.append(w)
        self.done: list[Job] = []

    def _workers(self, roles: str, dev: Device, name: str) -> list[Worker]:
        """The simulated workers an instance of `roles` builds (its record's `workers`)."""
        out: list[Worker] = []
        for w in role_set(roles).worker_sets:
            own = name if w.coupled or w.encodes_inline else f"{name}.{w.name}"
            if w.coupled:
                out.append(SimCoupledWorker(self, dev, own, encodes=w.encodes_inline))
                self.coupled.append(out[-1])
            elif w.prefills:
                out.append(SimPrefillWorker(self, dev, own, inline_encode=w.encodes_inline))
                self.prefillers.append(out[-1])
            elif w.decodes:
                out.append(SimDecodeWorker(self, dev, own))
                self.decoders.append(out[-1])
            else:
                out.append(SimEncodeWorker(self, dev, own))
                self.encoders.append(out[-1])
        return out

    # -- event loop --
    def at(self, t: float, fn) -> None:
        heapq.heappush(self._events, (t, next(self._seq), fn))

    def run(self, shapes: list[RequestShape]) -> list[Job]:
        jobs = [Job(s) for s in shapes]
        for job in jobs:
            self.at(job.shape.arrival_s, lambda t, j=job: self.arrive(t, j))
        budget = MAX_EVENTS_PER_REQUEST * max(1, len(jobs))
        while self._events:
            budget -= 1
            if budget < 0:
                raise SimulationError("simulation did not converge")
            t, _, fn = heapq.heappop(self._events)
            self.now = t
            fn(t)
        if len(self.done) != len(jobs):
            raise SimulationError(f"{len(jobs) - len(self.done)} request(s) never finished")
        return jobs

    # -- the request path --
    @staticmethod
    def _route(pool: list[Worker], work: float) -> Worker:
        w = min(pool, key=lambda w: (w.work, w.assigned))
        w.work += work
        w.assigned += 1
        return w

    def arrive(self, t: float, job: Job) -> None:
        pre = sum(self.costs.preprocess_ms(n) for n in job.shape.vision_items) / 1e3
        self.at(t + pre, lambda t2: self.dispatch(t2, job))

    def dispatch(self, t: float, job: Job) -> None:
        s = job.shape
        if self.coupled:
            w = self._route(self.coupled, s.prompt_tokens + s.output_tokens)
            job.prefill_worker = w
            if s.vision_items and w.kind.encodes_inline:
                job.items_left = len(s.vision_items)
                for n in s.vision_items:
                    w.add_item(t, job, n)
                return
        else:
            job.prefill_worker = self._route(self.prefillers, s.prompt_tokens)
            job.decode_worker = self._route(self.decoders, s.prompt_tokens + s.output_tokens)
        if s.vision_items and self.encoders and not job.prefill_worker.kind.encodes_inline:
            job.items_left = len(s.vision_items)
            for n in s.vision_items:
                self._route(self.encoders, 0).add_item(t, job, n)  # add_item counts the tokens as its work
            return
        job.prefill_worker.add(t, job)

    def item_encoded(self, t: float, job: Job) -> None:
        job.items_left -= 1
        if job.items_left == 0:
            delay = self.costs.feature_transfer_ms(job.shape.vision_tokens) / 1e3
            self.at(t + delay, lambda t2: job.prefill_worker.add(t2, job))

    def prefilled(self, t: float, job: Job) -> None:
        job.token_times.append(t)
        if job.remaining <= 0:
            job.decode_worker.work -= job.shape.prompt_tokens + job.shape.output_tokens
            self.finished(t, job)
            return
        delay = job.decode_worker.costs.kv_transfer_ms(job.shape.prompt_tokens) / 1e3  # the bytes D's ranks hold
        self.at(t + delay, lambda t2: job.decode_worker.add(t2, job))

    def finished(self, t: float, job: Job) -> None:
        self.done.append(job)


def to_record(job: Job) -> RequestRecord:
    s = job.shape
    return RequestRecord(
        request_id=s.request_id, t0=s.arrival_s, kind=s.kind,
        num_images=len(s.vision_items) if s.kind == "image" else 0, chunk_times=list(job.token_times),
        chunk_tokens=[1] * len(job.token_times), end=job.token_times[-1], success=True,
        expected_output_tokens=s.output_tokens, prompt_tokens=s.prompt_tokens, prompt_text_tokens=s.text_tokens,
        vision_tokens=s.vision_tokens, output_tokens=len(job.token_times))


def simulate(deployment: PlannedDeployment, costs: CostModel, shapes: list[RequestShape], tpot_pace_s: float = 0.1,
             limits: Limits | None = None) -> list[RequestRecord]:
    """Per-request records of `deployment` serving `shapes` (see the module docstring)."""
    sim = Simulation(deployment, costs, tpot_pace_s, limits)
    return [to_record(j) for j in sim.run(shapes)]
