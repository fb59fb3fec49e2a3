"""`HttpFront`: the OpenAI app, and `MetricsFront`: /metrics alone (`--metrics-port`), each served
by uvicorn on the event loop it is started from — the scheduler's own loop, so routes call the
`Dispatcher` directly, with no thread hop.

`AppServer` binds the socket itself (port 0 picks a free one; `address` says which) and hands it
to uvicorn; uvicorn installs no signal handlers (the `epdserve scheduler` command owns them).
"""
from __future__ import annotations

import asyncio
import contextlib
import logging
import socket

import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import PlainTextResponse

from epdserve.entrypoints.http.app import build_app
from epdserve.entrypoints.http.errors import ApiError
from epdserve.entrypoints.http.options import HttpOptions
from epdserve.security.secrets import bearer

log = logging.getLogger(__name__)


class _Server(uvicorn.Server):
    @contextlib.contextmanager
    def capture_signals(self):  # the host process owns SIGINT/SIGTERM
        yield


class AppServer:
    """One ASGI app served by uvicorn on the running loop: `await start()` -> host:port, `await stop()`."""

    def __init__(self, app, host: str, port: int, tls_cert: str | None = None, tls_key: str | None = None):
        self.app, self.host, self.port = app, host, port
        self.tls_cert, self.tls_key = tls_cert, tls_key
        self.address = ""
        self._server: _Server | None = None
        self._task: asyncio.Task | None = None

    @property
    def url(self) -> str:
        return f"{'https' if self.tls_cert else 'http'}://{self.address}"

    async def start(self) -> str:
        family = socket.AF_INET6 if ":" in self.host else socket.AF_INET
        sock = socket.socket(family, socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((self.host, self.port))
        sock.listen(1024)
        sock.setblocking(False)
        port = sock.getsockname()[1]
        host = self.host if self.host not in ("0.0.0.0", "::") else "127.0.0.1"
        self.address = f"{host}:{port}"
        config = uvicorn.Config(self.app, log_level="warning", access_log=False, lifespan="off",
                                ssl_certfile=self.tls_cert, ssl_keyfile=self.tls_key, timeout_graceful_shutdown=2)
        self._server = _Server(config)
        self._task = asyncio.create_task(self._server.serve(sockets=[sock]))
        while not self._server.started:
            if self._task.done():
                self._task.result()  # raises what stopped it
                raise OSError(f"the HTTP server on {self.address} stopped while starting")
            await asyncio.sleep(0.01)
        return self.address

    async def stop(self) -> None:
        if self._server is None:
            return
        self._server.should_exit = True
        if self._task is not None:
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await asyncio.wait_for(self._task, 5.0)
        self._server = None


class HttpFront(AppServer):
    """The OpenAI-compatible API of `scheduler` (a started SchedulerServer); /metrics when
    `metrics` (a `ServingMetrics`) is given, behind the API key when `metrics_auth`."""

    def __init__(self, scheduler, opts: HttpOptions, metrics=None, metrics_auth: bool = False):
        super().__init__(build_app(scheduler, opts, metrics, metrics_auth), opts.host, opts.port, opts.tls_cert,
                         opts.tls_key)
        self.opts = opts

    async def start(self) -> str:
        await super().start()
        log.info("OpenAI-compatible HTTP front on %s", self.url)
        return self.address


class MetricsFront(AppServer):
    """GET /metrics alone, for deployments without the HTTP front (`--metrics-port`); with
    `api_key` (a `Secret`), only for callers sending it as ``Authorization: Bearer``."""

    def __init__(self, metrics, host: str, port: int, tls_cert: str | None = None, tls_key: str | None = None,
                 api_key=None):
        app = FastAPI(docs_url=None, redoc_url=None, openapi_url=None)

        @app.get("/metrics")
        async def _metrics(request: Request):
            if api_key is not None and not api_key.matches(bearer(request.headers.get("authorization"))):
                log.warning("HTTP /metrics from %s refused: missing or wrong API key",
                            request.client.host if request.client else "?")
                return ApiError(401, "missing or invalid API key").response()
            data, content_type = metrics.render()
            return PlainTextResponse(data, media_type=content_type)

        super().__init__(app, host, port, tls_cert, tls_key)
