"""`AsyncClient`: the asyncio twin of `Client` (same methods, awaited; streams are async iterators;
the same addresses and resumption after a lost scheduler).

    async with AsyncClient("127.0.0.1:50051") as c:
        out = await c.generate("Hello", max_tokens=8)
        async for delta in c.generate_stream("Hello", max_tokens=8):
            ...
"""
from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from epdserve.client.connection import SchedulerConnection, retry_policy
from epdserve.client.messages import Delta, EPDServeError, GenerateResult, build_request, collect, collect_choices, \
    delta_from
from epdserve.client.resume import Resumption, RetryPolicy
from epdserve.rpc import serve_pb2


class AsyncClient(SchedulerConnection):
    def __init__(self, address, timeout: float | None = None, *, api_key: str | None = None,
                 tls_ca: str | None = None, tls: bool = False,
                 retry_deadline_s: float = RetryPolicy.deadline_s, retry_backoff_s: float = RetryPolicy.backoff_s,
                 retry_max_backoff_s: float = RetryPolicy.max_backoff_s, retries: int | None = RetryPolicy.retries):
        """As `Client`: one target or several, retry_deadline_s / retry_backoff_s /
        retry_max_backoff_s / retries, api_key (default: EPDSERVE_API_KEY), tls_ca / tls for a TLS port."""
        from epdserve.security import channels

        super().__init__(address, timeout, api_key, tls_ca, tls,
                         retry_policy(retry_deadline_s, retry_backoff_s, retry_max_backoff_s, retries), channels.aio_channel)

    async def generate(self, prompt=None, images=None, *, request_id: str = "", timeout: float | None = None,
                       **sampling) -> GenerateResult:
        req = build_request(prompt, images, request_id=request_id, **sampling)
        return collect([d async for d in self._stream(req, timeout)])

    def generate_stream(self, prompt=None, images=None, *, request_id: str = "", timeout: float | None = None,
                        **sampling) -> AsyncIterator[Delta]:
        return self._stream(build_request(prompt, images, request_id=request_id, **sampling), timeout)

    async def chat(self, messages: list[dict], *, add_generation_prompt: bool = True, request_id: str = "",
                   timeout: float | None = None, **sampling) -> GenerateResult:
        req = build_request(chat=messages, add_generation_prompt=add_generation_prompt, request_id=request_id,
                            **sampling)
        return collect([d async for d in self._stream(req, timeout)])

    async def generate_choices(self, prompt=None, images=None, *, n: int, request_id: str = "",
                               timeout: float | None = None, chat: list[dict] | None = None,
                               **sampling) -> list[GenerateResult]:
        """As `Client.generate_choices`: one request with n choices (sampling.n)."""
        req = build_request(prompt, images, chat=chat, request_id=request_id, **sampling)
        if n < 1:
            raise ValueError(f"n must be >= 1, got {n}")
        if n == 1:
            return [collect([d async for d in self._stream(req, timeout)])]
        req.sampling.n = n
        once = self._stream_once(req, timeout if timeout is not None else self.timeout)
        try:
            return collect_choices([d async for d in once], n)
        finally:
            await once.aclose()

    def chat_stream(self, messages: list[dict], *, add_generation_prompt: bool = True, request_id: str = "",
                    timeout: float | None = None, **sampling) -> AsyncIterator[Delta]:
        req = build_request(chat=messages, add_generation_prompt=add_generation_prompt, request_id=request_id,
                            **sampling)
        return self._stream(req, timeout)

    async def abort(self, request_id: str) -> bool:
        return (await self._call(self._stub.Abort, serve_pb2.AbortRequest(request_id=request_id), None)).found

    async def model_info(self) -> serve_pb2.ModelInfo:
        return await self._call(self._stub.GetModelInfo, serve_pb2.GetModelInfoRequest(), None)

    async def server_info(self) -> serve_pb2.ServerInfo:
        return await self._call(self._stub.GetServerInfo, serve_pb2.GetServerInfoRequest(), None)

    async def health(self, service: str = "") -> str:
        stub = health_pb2_grpc.HealthStub(self._channel)
        resp = await self._call(stub.Check, health_pb2.HealthCheckRequest(service=service), None)
        return health_pb2.HealthCheckResponse.ServingStatus.Name(resp.status)

    async def close(self) -> None:
        for ch in self._channels:
            await ch.close()

    async def __aenter__(self) -> AsyncClient:
        return self

    async def __aexit__(self, *exc) -> None:
        await self.close()

    async def _call(self, method, req, timeout):
        try:
            return await method(req, timeout=timeout if timeout is not None else self.timeout)
        except grpc.aio.AioRpcError as e:
            raise EPDServeError.from_rpc(e) from None

    async def _stream(self, req, timeout) -> AsyncIterator[Delta]:
        """The request's deltas; on UNAVAILABLE, resumed on the next address (resume.Resumption)."""
        run = Resumption(req, self.retry, timeout if timeout is not None else self.timeout)
        while True:
            attempt, left = run.attempt()
            once = self._stream_once(attempt, left)
            try:
                async for d in once:
                    run.delivered(d.token_ids)
                    yield d
                return
            except EPDServeError as e:
                wait = run.failed(e)
            finally:
                await once.aclose()  # cancels its call at once (also when the caller leaves early)
            self._next()
            await asyncio.sleep(wait)

    async def _stream_once(self, req, timeout) -> AsyncIterator[Delta]:
        call = self._stub.GenerateStream(req, timeout=timeout)
        try:
            while True:
                d = await call.read()
                if d is grpc.aio.EOF:
                    return
                yield delta_from(d)
        except grpc.aio.AioRpcError as e:
            raise EPDServeError.from_rpc(e) from None
        finally:
            call.cancel()
