"""`ServingMetrics`: the request-path metrics, observed on each public request's delta stream.

Per request: in flight (gauge); requests by status (``ok`` or the gRPC code name, INTERNAL for an
unexpected exception; requests a front refused or failed on before they reached the scheduler,
`refused`, under the code the gRPC API gives the same outcome: HTTP 400 INVALID_ARGUMENT, 500
INTERNAL, ...) and, when they finish, by finish reason; TTFT, inter-token latency, TPOT and
end-to-end latency (histograms, the scheduler's clock); each stage from the merged `StageTimings` (queue, encode, E→P, prefill,
P→D, first decode; see common.proto for the definitions); prompt / generation / vision / cached
vision tokens; MM Store outcomes in vision tokens (hit: served from the MM Store or an instance's
feature cache, as usage's cached count; recompute: encoded by P itself because E's features
did not come; miss: the rest, encoded for this request); retries (attempts beyond the first).

Recomputes and retries are read from the dispatcher's `RequestRun` when the last
delta arrives (read only: the run is still registered until the stream returns).

Refusals that never reach the request path are counted too: on the gRPC front by
`refusals.RefusalCounter` (`interceptor()`; the API key's UNAUTHENTICATED, ...), which learns
whether a call reached `observe` through `tracked_call`; on the HTTP front by the app
(`refused`). Every HTTP response besides, by route and HTTP status, in
``epdserve:http_responses_total`` (`http_responses`: why a counter of its own).
"""
from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator, Iterator
from contextvars import ContextVar

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from epdserve.metrics.http_responses import http_responses_counter
from epdserve.metrics.refusals import Reached, RefusalCounter
from epdserve.rpc import serve_pb2

P = "epdserve:"
_LATENCY = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0,
            40.0, 80.0)
_TOKEN_LATENCY = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.15, 0.2, 0.3, 0.5, 1.0, 2.5)
# stage -> (start field, end field) of StageTimings
STAGES = {"queue": ("arrival", "dispatched"), "encode": ("encode_start", "encode_end"),
          "e_to_p": ("encode_end", "prefill_start"), "prefill": ("prefill_start", "first_token"),
          "p_to_d": ("first_token", "kv_transfer_end"), "first_decode": ("kv_transfer_end", "first_decode")}


class ServingMetrics:
    def __init__(self):
        self.registry = CollectorRegistry(auto_describe=True)
        r = self.registry
        self.in_flight = Gauge(P + "num_requests_running", "Public requests in flight at the scheduler", registry=r)
        self.requests = Counter(P + "requests", "Public requests ended, by status (ok or the gRPC code; those "
                                "the HTTP front refused or failed on itself included, HTTP 500 as INTERNAL, and "
                                "gRPC calls refused before the servicer)", ["status"], registry=r)
        self.success = Counter(P + "request_success", "Requests finished, by finish reason", ["finished_reason"],
                               registry=r)
        self.ttft = Histogram(P + "time_to_first_token_seconds", "Arrival to first token", buckets=_LATENCY,
                              registry=r)
        self.itl = Histogram(P + "inter_token_latency_seconds", "Between consecutive streamed deltas",
                             buckets=_TOKEN_LATENCY, registry=r)
        self.tpot = Histogram(P + "time_per_output_token_seconds", "(end - first token) / (tokens - 1) per request",
                              buckets=_TOKEN_LATENCY, registry=r)
        self.e2e = Histogram(P + "e2e_request_latency_seconds", "Arrival to last token", buckets=_LATENCY,
                             registry=r)
        self.stage = Histogram(P + "request_stage_seconds", "Per-stage time of finished requests", ["stage"],
                               buckets=_LATENCY, registry=r)
        self.prompt_tokens = Counter(P + "prompt_tokens", "Prompt tokens of finished requests (vision included)",
                                     registry=r)
        self.generation_tokens = Counter(P + "generation_tokens", "Output tokens of finished requests", registry=r)
        self.vision_tokens = Counter(P + "vision_tokens", "Vision tokens of finished requests", registry=r)
        self.cached_vision_tokens = Counter(P + "cached_vision_tokens",
                                            "Vision tokens served from the MM Store / feature caches", registry=r)
        self.mm_store = Counter(P + "mm_store_vision_tokens", "Vision tokens per outcome: hit (features reused), "
                                "miss (encoded for the request), recompute (encoded by P, E's features missing)",
                                ["result"], registry=r)
        self.retries = Counter(P + "request_retries", "Attempts beyond the first (instance failures)", registry=r)
        for reason in ("stop", "length", "abort"):
            self.success.labels(reason)
        for result in ("hit", "miss", "recompute"):
            self.mm_store.labels(result)
        self.requests.labels("ok")
        self.http_responses = http_responses_counter(r)
        # the gRPC call being served, in its own task's context (`tracked_call`): per call, not shared
        self._call: ContextVar[Reached | None] = ContextVar(f"epdserve_call_{id(self):x}", default=None)

    def attach(self, scheduler) -> ServingMetrics:
        """Export the roster and instance-engine gauges of `scheduler` (a SchedulerServer)."""
        from epdserve.metrics.roster import RosterCollector

        self.registry.register(RosterCollector(scheduler))
        return self

    def refused(self, status: str) -> None:
        """A request a front refused before it reached the scheduler (`status`: a gRPC code name)."""
        self.requests.labels(status).inc()

    def interceptor(self) -> RefusalCounter:
        """For the public gRPC server, outermost: counts the generation calls refused before `observe`."""
        return RefusalCounter(self)

    @contextlib.contextmanager
    def tracked_call(self) -> Iterator[Reached]:
        """While a gRPC call is served inside: its mark, set when `observe` takes the request."""
        mark = Reached()
        token = self._call.set(mark)
        try:
            yield mark
        finally:
            with contextlib.suppress(ValueError):  # closed from another context (a finalized generator)
                self._call.reset(token)

    def render(self) -> tuple[bytes, str]:
        return generate_latest(self.registry), CONTENT_TYPE_LATEST

    async def observe(self, stream: AsyncIterator[serve_pb2.GenerateDelta], scheduler, tenant: str = ""
                      ) -> AsyncIterator[serve_pb2.GenerateDelta]:
        """`stream`, unchanged, with its request (of `tenant`: request ids are per tenant) measured."""
        start = time.monotonic()
        first = last = None
        status = "ok"
        mark = self._call.get()
        if mark is not None:  # a gRPC call: counted here, not by the interceptor
            mark.reached = True
        self.in_flight.inc()
        try:
            async for d in stream:
                now = time.monotonic()
                if d.token_ids:
                    if first is None:
                        first = now
                        self.ttft.observe(now - start)
                    else:
                        self.itl.observe(now - last)
                    last = now
                if d.finished:
                    self._finished(d, start, first, now, scheduler, tenant)
                yield d
        except (asyncio.CancelledError, GeneratorExit):  # the client went away
            status = "CANCELLED"
            raise
        except Exception as e:
            code = getattr(e, "code", None)
            status = code.name if code is not None and hasattr(code, "name") else "INTERNAL"
            raise
        finally:
            await stream.aclose()  # closing this stream closes the dispatcher's: the request is aborted
            self.in_flight.dec()
            self.requests.labels(status).inc()

    def _finished(self, d: serve_pb2.GenerateDelta, start: float, first: float | None, now: float,
                  scheduler, tenant: str = "") -> None:
        self.success.labels(d.finish_reason or "stop").inc()
        self.e2e.observe(now - start)
        n = d.usage.output_tokens
        if first is not None and n > 1:
            self.tpot.observe((now - first) / (n - 1))
        for stage, (a, b) in STAGES.items():
            t0, t1 = getattr(d.timing, a), getattr(d.timing, b)
            if t0 and t1 and t1 >= t0:
                self.stage.labels(stage).observe(t1 - t0)
        self.generation_tokens.inc(n)
        if d.index:  # choice j > 0 of a group (sampling.n): its prompt, media and retries were counted with choice 0
            return
        self.prompt_tokens.inc(d.usage.prompt_tokens)
        self.vision_tokens.inc(d.usage.vision_tokens)
        self.cached_vision_tokens.inc(d.usage.cached_vision_tokens)
        run = scheduler.dispatcher.runs.get((tenant, d.request_id)) if scheduler.dispatcher is not None else None
        recomputed = 0
        if run is not None:
            self.retries.inc(max(0, len(run.attempts) - 1))
            if run.attempt is not None:
                recomputed = sum(m.num_tokens for m in run.prep.media if m.key in run.attempt.report.recomputed)
        hit = d.usage.cached_vision_tokens
        recomputed = min(recomputed, d.usage.vision_tokens - hit)
        self.mm_store.labels("hit").inc(hit)
        self.mm_store.labels("recompute").inc(recomputed)
        self.mm_store.labels("miss").inc(d.usage.vision_tokens - hit - recomputed)
