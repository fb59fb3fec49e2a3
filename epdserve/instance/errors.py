"""Why a request failed on an instance, as the gRPC status the scheduler acts on.

- `InvalidRequestError` (epdserve.request_errors) → INVALID_ARGUMENT: the scheduler fails it;
- `TransientError` → ABORTED: e.g. a broken KV pair; the scheduler retries elsewhere;
- `BusyError` → RESOURCE_EXHAUSTED: queue or KV blocks full; the scheduler tries another one;
- anything else → UNAVAILABLE (the worker is stopping, broken or too slow to take the call).
"""
from __future__ import annotations

import grpc

from epdserve.request_errors import InvalidRequestError


class TransientError(RuntimeError):
    """Retrying elsewhere (or later) may succeed."""


class BusyError(RuntimeError):
    """No room for the request right now."""


def status_for(exc: BaseException) -> grpc.StatusCode:
    if isinstance(exc, InvalidRequestError):
        return grpc.StatusCode.INVALID_ARGUMENT
    if isinstance(exc, (BusyError, MemoryError)):
        return grpc.StatusCode.RESOURCE_EXHAUSTED
    if isinstance(exc, TransientError):
        return grpc.StatusCode.ABORTED
    return grpc.StatusCode.UNAVAILABLE


def output_error(out) -> BaseException:
    """The exception for an engine output that finished with an error: a transport or step
    failure (`out.retryable`) may succeed elsewhere; anything else is the request's own fault."""
    message = out.error or "request failed"
    return TransientError(message) if out.retryable else InvalidRequestError(message)
