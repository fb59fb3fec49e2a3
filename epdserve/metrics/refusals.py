"""`RefusalCounter`: the public gRPC generation calls that end before the request path measured
them, counted in ``epdserve:requests_total`` by the status the client receives.

`ServingMetrics.observe` counts every request that reaches `SchedulerServer.generate`. A call
can end before that: the API-key interceptor answers UNAUTHENTICATED, another interceptor or
the servicer refuses it first, or grpc cannot parse its message (UNKNOWN, as grpc answers an
exception in the request deserializer). This interceptor goes outermost on the public port and
wraps ``EPDServe/Generate`` and ``GenerateStream`` only (the other EPDServe calls are not
requests): per call it hands the request path a `Reached` mark through a context variable of
the `ServingMetrics` (`ServingMetrics.tracked_call`; the servicer runs inside this wrapper, in
the call's own task, so the mark is per call, not shared); a call that ends unmarked is counted
here with its status, a marked one was counted by the observer. So each call counts once.

Not observable here: a message over ``grpc.max_receive_message_length`` (the scheduler's
``max_message_bytes``). grpc-core refuses it with RESOURCE_EXHAUSTED while receiving it, after
the interceptors chose a handler and before any Python code gets the message, a status or a
context; the handler is never called. Such calls are not counted (the client's error says
``Received message larger than max``).
"""
from __future__ import annotations

import asyncio
import contextlib
import inspect

import grpc

from epdserve.rpc import SERVE_SERVICE

GENERATION_METHODS = frozenset(f"/{SERVE_SERVICE}/{m}" for m in ("Generate", "GenerateStream"))


class Reached:
    """One call's mark: set once the request path (`ServingMetrics.observe`) took the request."""

    __slots__ = ("reached",)

    def __init__(self):
        self.reached = False


def _status(context, error: BaseException | None) -> str:
    """The status the client receives: ``ok`` or the gRPC code name."""
    code = context.code()
    if code is None:
        if isinstance(error, asyncio.CancelledError):
            return "CANCELLED"
        if error is not None:
            return "UNKNOWN"  # grpc's answer to an exception it did not expect
        return "ok"
    return "ok" if code == grpc.StatusCode.OK else code.name


@contextlib.contextmanager
def _counted(metrics, context):
    """One call's body: counted with its status through `metrics.refused` unless the request path
    marked it (then the observer counted it)."""
    with metrics.tracked_call() as mark:
        try:
            yield
        except BaseException as e:
            if not mark.reached:
                metrics.refused(_status(context, e))
            raise
        if not mark.reached:
            metrics.refused(_status(context, None))


class RefusalCounter(grpc.aio.ServerInterceptor):
    """Counts, through `metrics.refused(status)`, the generation calls `metrics` did not observe
    (`metrics`: a `ServingMetrics`)."""

    def __init__(self, metrics):
        self.metrics = metrics

    async def intercept_service(self, continuation, details):
        handler = await continuation(details)
        if handler is None or details.method not in GENERATION_METHODS or handler.request_streaming:
            return handler
        metrics = self.metrics
        deserialize = handler.request_deserializer

        def parse(raw: bytes):
            try:
                return deserialize(raw) if deserialize is not None else raw
            except Exception:
                metrics.refused("UNKNOWN")  # grpc ends the call so; no handler runs
                raise

        if handler.response_streaming:
            inner_stream = handler.unary_stream

            async def stream_behavior(request, context):
                with _counted(metrics, context):
                    responses = inner_stream(request, context)
                    if hasattr(responses, "__aiter__"):
                        async for item in responses:
                            yield item
                    elif inspect.isawaitable(responses):  # a handler that writes with context.write
                        await responses

            return grpc.unary_stream_rpc_method_handler(stream_behavior, request_deserializer=parse,
                                                        response_serializer=handler.response_serializer)
        inner_unary = handler.unary_unary

        async def unary_behavior(request, context):
            with _counted(metrics, context):
                response = inner_unary(request, context)
                return await response if inspect.isawaitable(response) else response

        return grpc.unary_unary_rpc_method_handler(unary_behavior, request_deserializer=parse,
                                                   response_serializer=handler.response_serializer)
