"""The simulated stage workers: what each one queues and what one of its steps does.

A worker belongs to one simulated device (`simulate.Device`), which runs one step of one of its
workers at a time. Each worker offers `fifo_head()` (when its oldest queued encode/prefill work
became ready, None if none), `decoding()` (it has requests to decode) and `step(now) -> (ms,
done)`: the step's cost from the `CostModel` and what happens when it ends (`done(t)`).

- `SimEncodeWorker` (E): vision items FIFO, cut into chunks of at most `encode_token_budget` tokens;
  one step encodes queued chunks up to the budget in one call (at least one chunk).
- `SimPrefillWorker` (P, and P+E when `inline_encode`): one request per step; P+E encodes the
  request's media in the same step (EPD-Serve's PD baseline).
- `SimDecodeWorker` (D): continuous batching; a step is one token for every running request (up to
  `max_num_seqs`), at the profile's step time for that batch size; arrivals join at a step start.
- `SimCoupledWorker` (PD, EPD): one engine step loop: an encode call under the budget (EPD), then
  one forward with the admitted prefills (under `max_num_batched_tokens`) and the decode batch;
  a request whose media finish encoding in a step is prefilled in the same step.
Routing bookkeeping (`work`) is the scheduler's: outstanding vision tokens (E), prompt tokens
(P), prompt + output tokens (D, coupled).
"""
from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from epdserve.planner.shapes import RequestShape
from epdserve.roles import FUSED_PREFILL, ROLE_TABLE, RoleSet


@dataclass
class Job:
    """One request in flight; `token_times` gets a time per output token."""

    shape: RequestShape
    items_left: int = 0
    token_times: list[float] = field(default_factory=list)
    prefill_worker: object = None
    decode_worker: object = None

    @property
    def remaining(self) -> int:
        return self.shape.output_tokens - len(self.token_times)


@dataclass
class Limits:
    encode_token_budget: int = 1024
    max_num_batched_tokens: int = 2048
    max_num_seqs: int = 128


class Worker:
    kind: RoleSet | None = None  # the worker role set it simulates (epdserve/roles.py)

    def __init__(self, sim, device, name: str):
        self.sim, self.device, self.name = sim, device, name
        self.costs = sim.costs  # this instance's degree's (Simulation sets it)
        self.work = 0.0
        self.assigned = 0  # routing tie-break: fewer assignments first
        self.last_decode_end = 0.0

    def fifo_head(self) -> float | None:
        return None

    def decoding(self) -> bool:
        return False

    def decode_batch_size(self) -> int:
        return 0

    def step(self, now: float):
        raise NotImplementedError


def _chunks(tokens: int, budget: int) -> list[int]:
    return [min(budget, tokens - i) for i in range(0, tokens, budget)] or [0]


class SimEncodeWorker(Worker):
    kind = ROLE_TABLE["E"]

    def __init__(self, sim, device, name):
        super().__init__(sim, device, name)
        self.queue: deque = deque()  # (ready, job, tokens, last chunk of its item)

    def add_item(self, now: float, job: Job, tokens: int) -> None:
        parts = _chunks(tokens, self.sim.limits.encode_token_budget)
        for i, n in enumerate(parts):
            self.queue.append((now, job, n, i == len(parts) - 1))
        if not self.kind.holds_kv:  # a coupled worker's routing work is its requests' tokens
            self.work += tokens
        self.device.kick(now)

    def fifo_head(self):
        return self.queue[0][0] if self.queue else None

    def take(self) -> list:
        taken, total = [], 0
        while self.queue and (not taken or total + self.queue[0][2] <= self.sim.limits.encode_token_budget):
            taken.append(self.queue.popleft())
            total += taken[-1][2]
        return taken

    def step(self, now):
        taken = self.take()
        ms = self.costs.encode_ms(sum(c[2] for c in taken))

        def done(t):
            for _, job, n, last in taken:
                self.work -= n
                if last:
                    self.sim.item_encoded(t, job)
        return ms, done


class SimPrefillWorker(Worker):
    def __init__(self, sim, device, name, inline_encode: bool = False):
        super().__init__(sim, device, name)
        self.inline_encode = inline_encode
        self.kind = ROLE_TABLE[FUSED_PREFILL if inline_encode else "P"]
        self.queue: deque = deque()  # (ready, job)

    def add(self, now: float, job: Job) -> None:
        self.queue.append((now, job))
        self.device.kick(now)

    def fifo_head(self):
        return self.queue[0][0] if self.queue else None

    def step(self, now):
        _, job = self.queue.popleft()
        costs = self.costs
        ms = costs.prefill_ms(job.shape.prompt_tokens)
        if self.inline_encode:
            ms += costs.encode_ms(job.shape.vision_tokens)

        def done(t):
            self.work -= job.shape.prompt_tokens
            self.sim.prefilled(t, job)
        return ms, done


def decoded(worker, batch: list, t: float) -> None:
    """A decode step over `batch` ended at `t`: a token each; finished jobs leave `worker.batch`."""
    for job in batch:
        job.token_times.append(t)
        if job.remaining <= 0:
            worker.batch.remove(job)
            worker.work -= job.shape.prompt_tokens + job.shape.output_tokens
            worker.sim.finished(t, job)


class SimDecodeWorker(Worker):
    kind = ROLE_TABLE["D"]

    def __init__(self, sim, device, name):
        super().__init__(sim, device, name)
        self.incoming: deque = deque()
        self.batch: list[Job] = []

    def add(self, now: float, job: Job) -> None:
        self.incoming.append(job)
        self.device.kick(now)

    def decoding(self):
        return bool(self.batch or self.incoming)

    def decode_batch_size(self):
        return min(self.sim.limits.max_num_seqs, len(self.batch) + len(self.incoming))

    def step(self, now):
        while self.incoming and len(self.batch) < self.sim.limits.max_num_seqs:
            self.batch.append(self.incoming.popleft())
        batch = list(self.batch)
        ms = self.costs.decode_ms(len(batch))

        def done(t):
            self.last_decode_end = t
            decoded(self, batch, t)
        return ms, done


class SimCoupledWorker(SimEncodeWorker):
    """PD (no encoder: media come encoded from E) or EPD (encodes its own media)."""

    def __init__(self, sim, device, name, encodes: bool):
        super().__init__(sim, device, name)
        self.kind = ROLE_TABLE["EPD" if encodes else "PD"]
        self.prefill_q: deque = deque()  # (ready, job)
        self.batch: list[Job] = []

    def add(self, now: float, job: Job) -> None:
        """A request ready to prefill (text-only, or its features arrived)."""
        self.prefill_q.append((now, job))
        self.device.kick(now)

    def fifo_head(self):
        heads = [q[0][0] for q in (self.queue, self.prefill_q) if q]
        return min(heads) if heads else None

    def decoding(self):
        return bool(self.batch)

    def decode_batch_size(self):
        return len(self.batch)

    def step(self, now):
        lim, costs = self.sim.limits, self.costs
        enc = self.take() if self.queue else []
        lasts: dict[int, int] = {}
        for _, job, _, last in enc:
            lasts[id(job)] = lasts.get(id(job), 0) + int(last)
        encoded = {id(j): j for _, j, _, _ in enc if lasts[id(j)] == j.items_left}
        ready = list(self.prefill_q) + [(now, j) for j in encoded.values()]
        batch = list(self.batch)
        admitted, tokens = [], 0
        budget = lim.max_num_batched_tokens - len(batch)
        for item in ready:
            n = item[1].shape.prompt_tokens
            if admitted and (tokens + n > budget or len(batch) + len(admitted) >= lim.max_num_seqs):
                break
            admitted.append(item)
            tokens += n
        for _ in range(min(len(admitted), len(self.prefill_q))):
            self.prefill_q.popleft()
        ms = costs.encode_ms(sum(c[2] for c in enc)) + (costs.prefill_ms(tokens) if admitted else 0.0) + \
            costs.decode_ms(len(batch))
        admitted_jobs = {id(j) for _, j in admitted}

        def done(t):
            for _, job, _, last in enc:
                if last:
                    job.items_left -= 1
                    if job.items_left == 0 and id(job) not in admitted_jobs:
                        self.prefill_q.append((t, job))
            if batch:
                self.last_decode_end = t
            decoded(self, batch, t)
            for _, job in admitted:
                job.items_left = 0
                job.token_times.append(t)
                if job.remaining <= 0:
                    self.work -= job.shape.prompt_tokens + job.shape.output_tokens
                    self.sim.finished(t, job)
                else:
                    self.batch.append(job)
        return ms, done
