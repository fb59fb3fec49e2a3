"""``epdserve:http_responses_total{route,status}``: every response of the HTTP front, by route
template and HTTP status, and `CountResponses`, the ASGI middleware that counts them.

Why a counter of its own, not a ``route`` label on ``epdserve:requests_total``: that counter
means "public generation requests ended, by status", whichever front they came by, with gRPC
code names as statuses (``ok``, ``INVALID_ARGUMENT``, ...); its series and their meaning stay as
dashboards know them. A 401 on /v1/models, a 404 for an unknown path or a 405 is no generation
request, and HTTP statuses are not gRPC codes. vLLM does the same split: its engine counters
(``vllm:request_success_total``) beside prometheus-fastapi-instrumentator's
``http_requests_total{handler,method,status}`` for the HTTP server; Prometheus' naming guide asks
for one meaning per metric name. So a refused generation request on the HTTP front counts in both:
in ``epdserve:requests_total`` as a request (status ``INVALID_ARGUMENT``), here as a response
(route ``/v1/chat/completions``, status ``400``).

Labels are bounded: ``route`` is the template of the route that answered (Starlette's
``scope["route"]``, a 405 included) or ``unmatched`` (a 404 for an unknown path, a trailing-slash
redirect), never the path the client sent; ``status`` is the HTTP status as a number (no method
label: a client may send any method name). Every response counts, 2xx and /metrics scrapes
included, so ratios need no second source. A request no response started for is counted 500
(an exception no handler answered: Starlette's outermost `ServerErrorMiddleware` answers it,
outside this middleware), or 499 when it was cancelled (nginx's "client closed request", which
the front answers itself when a generation's client goes).
"""
from __future__ import annotations

import asyncio

from prometheus_client import CollectorRegistry, Counter

NAME = "epdserve:http_responses"
UNMATCHED = "unmatched"


def http_responses_counter(registry: CollectorRegistry) -> Counter:
    return Counter(NAME, "HTTP front responses, by route template (or 'unmatched') and HTTP status",
                   ["route", "status"], registry=registry)


class CountResponses:
    """ASGI middleware: each HTTP request's response counted once in `counter`, by route and status."""

    def __init__(self, app, counter: Counter):
        self.app = app
        self.counter = counter

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        status = None

        async def send_counted(message):
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
            await send(message)

        unanswered = 500  # what the client gets when no response started: uvicorn's (or Starlette's) 500
        try:
            await self.app(scope, receive, send_counted)
        except asyncio.CancelledError:
            unanswered = 499
            raise
        finally:
            route = getattr(scope.get("route"), "path", None) or UNMATCHED
            self.counter.labels(route, str(status or unanswered)).inc()
