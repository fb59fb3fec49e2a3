"""How `Client` / `AsyncClient` survive a lost scheduler: retry the request, resuming it.

A generation call that fails with UNAVAILABLE (the scheduler died, restarts, or the connection
broke: gRPC reports all of them so) is sent again — to the next of the client's scheduler
targets, or the same one when it has only one — after a capped exponential backoff
(`backoff_s`, doubling, at most `max_backoff_s`), for as long as `RetryPolicy.deadline_s` lasts
(60 s by default), counted from the first of the failures in a row: a budget of time, not of
tries, since what it waits for (a scheduler's restart) takes time, and on a loaded machine more
than the ~23 s that 8 doubling retries gave. The last try falls on the deadline itself. An attempt
that delivered tokens starts a new budget. The call's own `timeout` still bounds everything.
The new request carries the token ids already received in
`resume_token_ids`: the scheduler continues after them (prompt + those ids, max_tokens reduced),
so nothing is streamed twice and greedy output is unchanged. Token ids, never re-tokenised text:
outputs stay exact. (As with the scheduler's own resume: a stop string spanning the resume point
is not seen, and a seeded sampled request continues with a fresh random stream.)

Other codes are the caller's (INVALID_ARGUMENT, RESOURCE_EXHAUSTED, DEADLINE_EXCEEDED, ...).

`Resumption` is that loop written once, with no I/O of its own: one generation's state (tokens
received, failures in a row, the call's deadline) and its decisions (the next attempt's request
and time left; after a failure, the wait or the error). `Client` and `AsyncClient` each wrap it
in the few lines that differ between them: how a stream is read and how a wait is slept.
"""
from __future__ import annotations

import time
from dataclasses import dataclass

import grpc

from epdserve.rpc import serve_pb2

RETRYABLE = frozenset({grpc.StatusCode.UNAVAILABLE})


@dataclass(frozen=True)
class RetryPolicy:
    deadline_s: float = 60.0  # how long to keep retrying after the first failure in a row (0: never retry)
    backoff_s: float = 0.25  # before the first retry; doubles with each retry in a row
    max_backoff_s: float = 5.0  # the cap on one wait
    retries: int | None = None  # also stop after this many retries in a row (None: the deadline alone)

    def __post_init__(self):
        if self.deadline_s < 0 or self.backoff_s < 0 or self.max_backoff_s < self.backoff_s:
            raise ValueError("retry policy: need deadline_s >= 0 and 0 <= backoff_s <= max_backoff_s")
        if self.retries is not None and self.retries < 0:
            raise ValueError("retry policy: retries is None or >= 0")

    def wait_s(self, retry: int) -> float:
        """The backoff before retry number `retry` (1, 2, ...) in a row."""
        return min(self.max_backoff_s, self.backoff_s * 2 ** min(retry - 1, 64))

    def wait_after(self, error, failures: int, since: float, deadline: float | None) -> float:
        """The wait before retrying after `error` (an EPDServeError) ended the `failures`-th
        failed attempt in a row (1, 2, ...), the first of which failed at `since`
        (time.monotonic); re-raises it when its code is not retryable, the budget (`deadline_s`
        after `since`, or `retries`) is spent, or the wait would pass the call's `deadline`."""
        now = time.monotonic()
        end = since + self.deadline_s
        if (not retryable(error.code) or now >= end
                or (self.retries is not None and failures > self.retries)):
            raise error
        wait = min(self.wait_s(failures), end - now)  # the last try falls on the deadline
        if deadline is not None and now + wait >= deadline:
            raise error
        return wait


class Resumption:
    """One generation across its attempts. The client's loop, sync or async, is:

        run = Resumption(req, policy, timeout)
        while True:
            attempt, left = run.attempt()       # the request to send now, and its time left (s)
            try:
                for delta in stream(attempt, left):
                    run.delivered(delta.token_ids)
                    yield delta
                return
            except EPDServeError as e:
                wait = run.failed(e)            # re-raises e when no retry is left
            next_target(); sleep(wait)
    """

    def __init__(self, req: serve_pb2.GenerateRequest, policy: RetryPolicy, timeout: float | None):
        self.req = req
        self.policy = policy
        self.deadline = None if timeout is None else time.monotonic() + timeout
        self.received: list[int] = []  # token ids delivered to the caller, over every attempt
        self.failures = 0  # failed attempts in a row
        self._since = 0.0  # when the first of them failed (time.monotonic)
        self._got = 0  # len(received) when the current attempt started

    def attempt(self) -> tuple[serve_pb2.GenerateRequest, float | None]:
        """Start an attempt: the request to send (resuming after what was received) and the
        time left of the call (None: no deadline)."""
        self._got = len(self.received)
        left = None if self.deadline is None else max(0.0, self.deadline - time.monotonic())
        return resumed(self.req, self.received), left

    def delivered(self, token_ids) -> None:
        """The current attempt delivered these token ids to the caller."""
        self.received.extend(token_ids)

    def failed(self, error) -> float:
        """The current attempt ended with `error` (an EPDServeError): the wait before the next
        one, or `error` raised when the policy allows no more (resume's rules above). An attempt
        that delivered tokens, or a first failure, starts a new budget."""
        if len(self.received) > self._got or self.failures == 0:
            self.failures, self._since = 0, time.monotonic()
        self.failures += 1
        return self.policy.wait_after(error, self.failures, self._since, self.deadline)


def retryable(code: grpc.StatusCode) -> bool:
    return code in RETRYABLE


def resumed(req: serve_pb2.GenerateRequest, received: list[int]) -> serve_pb2.GenerateRequest:
    """`req` again, resuming after the token ids `received` so far (if any)."""
    if not received:
        return req
    out = serve_pb2.GenerateRequest()
    out.CopyFrom(req)
    out.resume_token_ids.extend(received)
    return out
