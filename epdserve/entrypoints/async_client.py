"""`AsyncClient`: the asyncio twin of `Client` (same methods, awaited; streams are async iterators).

    async with AsyncClient("127.0.0.1:50051") as c:
        out = await c.generate("Hello", max_tokens=8)
        async for delta in c.generate_stream("Hello", max_tokens=8):
            ...
"""
from __future__ import annotations

from collections.abc import AsyncIterator

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from epdserve.entrypoints.client import (
    CHANNEL_OPTIONS,
    Delta,
    EPDServeError,
    GenerateResult,
    build_request,
    delta_from,
    result_from,
)
from epdserve.rpc import serve_pb2, serve_pb2_grpc


class AsyncClient:
    def __init__(self, address: str, timeout: float | None = None):
        self.address = address
        self.timeout = timeout
        self._channel = grpc.aio.insecure_channel(address, options=CHANNEL_OPTIONS)
        self._stub = serve_pb2_grpc.EPDServeStub(self._channel)

    async def generate(self, prompt=None, images=None, *, request_id: str = "", timeout: float | None = None,
                       **sampling) -> GenerateResult:
        req = build_request(prompt, images, request_id=request_id, **sampling)
        return result_from(await self._call(self._stub.Generate, req, timeout))

    def generate_stream(self, prompt=None, images=None, *, request_id: str = "", timeout: float | None = None,
                        **sampling) -> AsyncIterator[Delta]:
        return self._stream(build_request(prompt, images, request_id=request_id, **sampling), timeout)

    async def chat(self, messages: list[dict], *, add_generation_prompt: bool = True, request_id: str = "",
                   timeout: float | None = None, **sampling) -> GenerateResult:
        req = build_request(chat=messages, add_generation_prompt=add_generation_prompt, request_id=request_id,
                            **sampling)
        return result_from(await self._call(self._stub.Generate, req, timeout))

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
        await self._channel.close()

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
        call = self._stub.GenerateStream(req, timeout=timeout if timeout is not None else self.timeout)
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
