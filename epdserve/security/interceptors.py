"""gRPC interceptors: servers check the API key / cluster token, clients send them.

`Rule(prefix, accepts, what)`: calls whose method starts with `prefix` need one of `accepts`
— (metadata key, Secret) pairs; `authorization` is read as ``Bearer <value>``. A refused call
ends with UNAUTHENTICATED before the servicer sees it, and is logged with the method and the
peer (never the value presented). Methods no rule names (health checks) are open.
`AioAuthInterceptor` serves grpc.aio servers (the scheduler), `AuthInterceptor` threaded ones
(instances). `metadata_interceptors(pairs)` / `aio_metadata_interceptors(pairs)` add metadata
to every call on a channel (`grpc.intercept_channel` / `grpc.aio.*_channel(interceptors=...)`).
"""
from __future__ import annotations

import logging
from dataclasses import dataclass

import grpc

from epdserve.security.secrets import AUTHORIZATION, Secret, bearer

log = logging.getLogger(__name__)

_MAKERS = {
    (False, False): grpc.unary_unary_rpc_method_handler,
    (False, True): grpc.unary_stream_rpc_method_handler,
    (True, False): grpc.stream_unary_rpc_method_handler,
    (True, True): grpc.stream_stream_rpc_method_handler,
}


@dataclass
class Rule:
    prefix: str
    accepts: list[tuple[str, Secret]]
    what: str  # "API key" | "cluster token"

    def allows(self, metadata: dict[str, str]) -> bool:
        for key, secret in self.accepts:
            value = metadata.get(key)
            if key == AUTHORIZATION:
                value = bearer(value)
            if secret.matches(value):
                return True
        return False


def _rule(rules: list[Rule], method: str) -> Rule | None:
    return next((r for r in rules if method.startswith(r.prefix)), None)


def _metadata(details) -> dict[str, str]:
    return {k: v for k, v in (details.invocation_metadata or ()) if isinstance(v, str)}


class AioAuthInterceptor(grpc.aio.ServerInterceptor):
    def __init__(self, rules: list[Rule]):
        self.rules = rules

    async def intercept_service(self, continuation, details):
        handler = await continuation(details)
        rule = _rule(self.rules, details.method)
        if handler is None or rule is None or rule.allows(_metadata(details)):
            return handler
        message = f"missing or wrong {rule.what}"

        async def deny_unary(request, context):
            log.warning("refused %s from %s: %s", details.method, context.peer(), message)
            await context.abort(grpc.StatusCode.UNAUTHENTICATED, message)

        async def deny_stream(request, context):
            log.warning("refused %s from %s: %s", details.method, context.peer(), message)
            await context.abort(grpc.StatusCode.UNAUTHENTICATED, message)
            yield  # never reached: makes this a response stream

        return _MAKERS[handler.request_streaming, handler.response_streaming](
            deny_stream if handler.response_streaming else deny_unary,
            request_deserializer=handler.request_deserializer, response_serializer=handler.response_serializer)


class AuthInterceptor(grpc.ServerInterceptor):
    def __init__(self, rules: list[Rule]):
        self.rules = rules

    def intercept_service(self, continuation, details):
        handler = continuation(details)
        rule = _rule(self.rules, details.method)
        if handler is None or rule is None or rule.allows(_metadata(details)):
            return handler
        message = f"missing or wrong {rule.what}"

        def deny_unary(request, context):
            log.warning("refused %s from %s: %s", details.method, context.peer(), message)
            context.abort(grpc.StatusCode.UNAUTHENTICATED, message)

        def deny_stream(request, context):
            log.warning("refused %s from %s: %s", details.method, context.peer(), message)
            context.abort(grpc.StatusCode.UNAUTHENTICATED, message)
            yield  # never reached: makes this a response stream

        return _MAKERS[handler.request_streaming, handler.response_streaming](
            deny_stream if handler.response_streaming else deny_unary,
            request_deserializer=handler.request_deserializer, response_serializer=handler.response_serializer)


# ---------------------------------------------------------------- clients
class _SyncAdd(grpc.UnaryUnaryClientInterceptor, grpc.UnaryStreamClientInterceptor,
               grpc.StreamUnaryClientInterceptor, grpc.StreamStreamClientInterceptor):
    def __init__(self, pairs: list[tuple[str, str]]):
        self.pairs = pairs

    def _details(self, d):
        return _SyncDetails(d.method, d.timeout, [*(d.metadata or ()), *self.pairs], d.credentials,
                            getattr(d, "wait_for_ready", None), getattr(d, "compression", None))

    def intercept_unary_unary(self, continuation, d, request):
        return continuation(self._details(d), request)

    def intercept_unary_stream(self, continuation, d, request):
        return continuation(self._details(d), request)

    def intercept_stream_unary(self, continuation, d, request_iterator):
        return continuation(self._details(d), request_iterator)

    def intercept_stream_stream(self, continuation, d, request_iterator):
        return continuation(self._details(d), request_iterator)


class _SyncDetails(grpc.ClientCallDetails):
    def __init__(self, method, timeout, metadata, credentials, wait_for_ready, compression):
        self.method, self.timeout, self.metadata = method, timeout, metadata
        self.credentials, self.wait_for_ready, self.compression = credentials, wait_for_ready, compression


class _AioAdd:
    def __init__(self, pairs: list[tuple[str, str]]):
        self.pairs = pairs

    def _details(self, d):
        return grpc.aio.ClientCallDetails(d.method, d.timeout, grpc.aio.Metadata(*(d.metadata or ()), *self.pairs),
                                          d.credentials, d.wait_for_ready)


# grpc.aio files each interceptor under the first call kind it implements: one class per kind
class _AioUnaryUnary(_AioAdd, grpc.aio.UnaryUnaryClientInterceptor):
    async def intercept_unary_unary(self, continuation, d, request):
        return await continuation(self._details(d), request)


class _AioUnaryStream(_AioAdd, grpc.aio.UnaryStreamClientInterceptor):
    async def intercept_unary_stream(self, continuation, d, request):
        return await continuation(self._details(d), request)


class _AioStreamUnary(_AioAdd, grpc.aio.StreamUnaryClientInterceptor):
    async def intercept_stream_unary(self, continuation, d, request_iterator):
        return await continuation(self._details(d), request_iterator)


class _AioStreamStream(_AioAdd, grpc.aio.StreamStreamClientInterceptor):
    async def intercept_stream_stream(self, continuation, d, request_iterator):
        return await continuation(self._details(d), request_iterator)


def metadata_interceptors(pairs: list[tuple[str, str]]) -> list:
    """For `grpc.intercept_channel(channel, *metadata_interceptors(pairs))` (empty: nothing to add)."""
    return [_SyncAdd(pairs)] if pairs else []


def aio_metadata_interceptors(pairs: list[tuple[str, str]]) -> list | None:
    if not pairs:
        return None
    return [kind(pairs) for kind in (_AioUnaryUnary, _AioUnaryStream, _AioStreamUnary, _AioStreamStream)]


def api_key_metadata(key: Secret | None) -> list[tuple[str, str]]:
    return [(AUTHORIZATION, f"Bearer {key.reveal()}")] if key is not None else []


def cluster_metadata(token: Secret | None) -> list[tuple[str, str]]:
    from epdserve.security.secrets import CLUSTER_TOKEN_HEADER

    return [(CLUSTER_TOKEN_HEADER, token.reveal())] if token is not None else []
