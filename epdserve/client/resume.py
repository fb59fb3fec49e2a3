"""How `Client` / `AsyncClient` survive a lost scheduler: retry the request, resuming it.

A generation call that fails with UNAVAILABLE (the scheduler died, restarts, or the connection
broke: gRPC reports all of them so) is sent again — to the next of the client's scheduler
addresses, or the same one when it has only one — after a capped exponential backoff, at most
`RetryPolicy.retries` times. The new request carries the token ids already received in
`resume_token_ids`: the scheduler continues after them (prompt + those ids, max_tokens reduced),
so nothing is streamed twice and greedy output is unchanged. Token ids, never re-tokenised text:
outputs stay exact. (As with the scheduler's own resume: a stop string spanning the resume point
is not seen, and a seeded sampled request continues with a fresh random stream.)

Other codes are the caller's (INVALID_ARGUMENT, RESOURCE_EXHAUSTED, DEADLINE_EXCEEDED, ...).
"""
from __future__ import annotations

import time
from dataclasses import dataclass

import grpc

from epdserve.rpc import serve_pb2

RETRYABLE = frozenset({grpc.StatusCode.UNAVAILABLE})


@dataclass(frozen=True)
class RetryPolicy:
    retries: int = 8  # attempts after the first, over all addresses (0: never retry)
    backoff_s: float = 0.25  # before the first retry; doubles with each retry
    max_backoff_s: float = 5.0  # 0.25 + 0.5 + ... capped: ~23 s in all, enough for a scheduler restart

    def __post_init__(self):
        if self.retries < 0 or self.backoff_s < 0 or self.max_backoff_s < self.backoff_s:
            raise ValueError("retry policy: need retries >= 0 and 0 <= backoff_s <= max_backoff_s")

    def wait_s(self, retry: int) -> float:
        """The wait before retry number `retry` (1, 2, ...)."""
        return min(self.max_backoff_s, self.backoff_s * 2 ** (retry - 1))

    def wait_after(self, error, attempt: int, deadline: float | None) -> float:
        """The wait before retrying after `error` (an EPDServeError) ended attempt `attempt` (0,
        1, ...); re-raises it when its code is not retryable, the retries are spent, or the wait
        would pass `deadline` (time.monotonic)."""
        wait = self.wait_s(attempt + 1)
        if (not retryable(error.code) or attempt == self.retries
                or (deadline is not None and time.monotonic() + wait >= deadline)):
            raise error
        return wait


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
