"""OpenAI-style errors: `ApiError` (status, message, type) and the gRPC-status → HTTP map, and
`LastResort`, which makes an exception nothing else answered one of them.

Body shape (as OpenAI and vLLM answer): ``{"error": {"message", "type", "param", "code"}}``.
400 bad input (and a Host not served: `fence`), 401 bad key, 404 unknown model/route, 405 wrong
method, 413 body too large, 415 a POST body that is not JSON, 429 queues (or the tenant's quota)
full, with ``Retry-After``, 500 an unexpected failure (its type only; the traceback goes to the log), 503 no
instance can serve, 504 deadline. `grpc_code`: the gRPC code of a status, the `status` label the
metrics count it under (500 → INTERNAL).
"""
from __future__ import annotations

import logging

import grpc
from fastapi.responses import JSONResponse

_TYPES = {400: "BadRequestError", 401: "AuthenticationError", 404: "NotFoundError", 405: "MethodNotAllowedError",
          413: "BadRequestError", 415: "UnsupportedMediaTypeError", 429: "RateLimitError", 499: "ClientClosedRequest", 500: "InternalServerError",
          503: "ServiceUnavailableError", 504: "TimeoutError"}

_FROM_GRPC = {
    grpc.StatusCode.INVALID_ARGUMENT: 400,
    grpc.StatusCode.FAILED_PRECONDITION: 400,
    grpc.StatusCode.OUT_OF_RANGE: 400,
    grpc.StatusCode.NOT_FOUND: 404,
    grpc.StatusCode.UNAUTHENTICATED: 401,
    grpc.StatusCode.PERMISSION_DENIED: 401,
    grpc.StatusCode.RESOURCE_EXHAUSTED: 429,
    grpc.StatusCode.UNAVAILABLE: 503,
    grpc.StatusCode.DEADLINE_EXCEEDED: 504,
    grpc.StatusCode.CANCELLED: 499,
}


# a status the front answers itself -> the gRPC code the same outcome gets on the gRPC API (the
# `status` label of epdserve:requests_total, so both fronts count alike; 413: limits.LimitError's)
_TO_GRPC = {400: grpc.StatusCode.INVALID_ARGUMENT, 401: grpc.StatusCode.UNAUTHENTICATED,
            404: grpc.StatusCode.NOT_FOUND, 413: grpc.StatusCode.RESOURCE_EXHAUSTED,
            415: grpc.StatusCode.INVALID_ARGUMENT,
            429: grpc.StatusCode.RESOURCE_EXHAUSTED, 499: grpc.StatusCode.CANCELLED,
            500: grpc.StatusCode.INTERNAL, 503: grpc.StatusCode.UNAVAILABLE, 504: grpc.StatusCode.DEADLINE_EXCEEDED}


RETRY_AFTER_S = 1  # what a 429 tells a client to wait: a slot frees when any request in flight ends


class ApiError(Exception):
    def __init__(self, status: int, message: str, param: str | None = None):
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param

    @classmethod
    def from_grpc(cls, code: grpc.StatusCode, message: str) -> ApiError:
        return cls(_FROM_GRPC.get(code, 500), message)

    @classmethod
    def internal(cls, what: str, e: BaseException) -> ApiError:
        """A 500 for an unexpected exception while `what` (the caller logs the traceback): the
        error's type, never its text or a traceback."""
        return cls(500, f"internal error in the server while {what} ({type(e).__name__}); its log has the details")

    @property
    def grpc_code(self) -> grpc.StatusCode:
        return _TO_GRPC.get(self.status, grpc.StatusCode.UNKNOWN)

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": _TYPES.get(self.status, "Error"), "param": self.param,
                          "code": self.status}}

    def response(self) -> JSONResponse:
        headers = {"WWW-Authenticate": "Bearer"} if self.status == 401 else \
            {"Retry-After": str(RETRY_AFTER_S)} if self.status == 429 else None
        return JSONResponse(self.body(), status_code=self.status, headers=headers)


class LastResort:
    """ASGI middleware: an exception no handler answered is a JSON 500 in OpenAI's shape (its type
    only), logged once with its traceback on `log`. (Starlette's own last resort answers plain text
    and re-raises, so the server logs the traceback a second time.) Once a response has started,
    only the log says it: the client's connection is closed."""

    def __init__(self, app, log: logging.Logger):
        self.app = app
        self.log = log

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        started = False

        async def send_started(message):
            nonlocal started
            started = started or message["type"] == "http.response.start"
            await send(message)

        try:
            await self.app(scope, receive, send_started)
        except Exception as e:
            self.log.error("HTTP %s %s failed", scope.get("method", ""), scope.get("path", ""), exc_info=e)
            if not started:
                await ApiError.internal(f"serving {scope.get('path', '')}", e).response()(scope, receive, send)
