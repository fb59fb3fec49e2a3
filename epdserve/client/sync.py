"""`Client`: the blocking client of a deployment's `EPDServe` service (see the package's docstring)."""
from __future__ import annotations

import time
from collections.abc import Iterator

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from epdserve.client.connection import SchedulerConnection, retry_policy
from epdserve.client.messages import Delta, EPDServeError, GenerateResult, build_request, collect, collect_choices, \
    delta_from
from epdserve.client.resume import Resumption, RetryPolicy
from epdserve.rpc import serve_pb2


class Client(SchedulerConnection):
    def __init__(self, address, timeout: float | None = None, *, api_key: str | None = None,
                 tls_ca: str | None = None, tls: bool = False,
                 retry_deadline_s: float = RetryPolicy.deadline_s, retry_backoff_s: float = RetryPolicy.backoff_s,
                 retry_max_backoff_s: float = RetryPolicy.max_backoff_s, retries: int | None = RetryPolicy.retries):
        """address: "host:port" of the scheduler, a gRPC target that resolves to several
        ("dns:///scheduler.ns.svc:50051": a Kubernetes Service), or a list of them (schedulers
        sharing the instances); timeout: default deadline (s) of each call (a retried generation:
        of all its attempts together). A generation that lost its scheduler is resumed for up to
        retry_deadline_s (60 s) after the first failure in a row, waiting retry_backoff_s (0.25 s)
        doubling up to retry_max_backoff_s (5 s) between tries (resume.py; retry_deadline_s=0 or
        retries=0: never; retries: also a cap on the tries in a row). api_key: sent as ``authorization: Bearer``
        (default: EPDSERVE_API_KEY, if set); tls_ca: a PEM file of the roots to trust, for a TLS
        port (`tls=True`: TLS with the system's roots)."""
        from epdserve.security import channels

        super().__init__(address, timeout, api_key, tls_ca, tls,
                         retry_policy(retry_deadline_s, retry_backoff_s, retry_max_backoff_s, retries), channels.channel)

    def generate(self, prompt=None, images=None, *, request_id: str = "", timeout: float | None = None,
                 **sampling) -> GenerateResult:
        req = build_request(prompt, images, request_id=request_id, **sampling)
        return collect(list(self._stream(req, timeout)))

    def generate_stream(self, prompt=None, images=None, *, request_id: str = "", timeout: float | None = None,
                        **sampling) -> Iterator[Delta]:
        return self._stream(build_request(prompt, images, request_id=request_id, **sampling), timeout)

    def chat(self, messages: list[dict], *, add_generation_prompt: bool = True, request_id: str = "",
             timeout: float | None = None, **sampling) -> GenerateResult:
        req = build_request(chat=messages, add_generation_prompt=add_generation_prompt, request_id=request_id,
                            **sampling)
        return collect(list(self._stream(req, timeout)))

    def generate_choices(self, prompt=None, images=None, *, n: int, request_id: str = "",
                         timeout: float | None = None, chat: list[dict] | None = None,
                         **sampling) -> list[GenerateResult]:
        """OpenAI's `n`: `n` results for one prompt (or `chat` messages), each its own sequence
        (seeded: seed + j), served as one request whose prompt is prefilled once (a sequence group:
        sampling.n). Not resumed on another scheduler once its output started (a group does not
        resume; UNAVAILABLE raises)."""
        req = build_request(prompt, images, chat=chat, request_id=request_id, **sampling)
        if n < 1:
            raise ValueError(f"n must be >= 1, got {n}")
        if n == 1:
            return [collect(list(self._stream(req, timeout)))]
        req.sampling.n = n
        return collect_choices(self._stream_once(req, timeout if timeout is not None else self.timeout), n)

    def chat_stream(self, messages: list[dict], *, add_generation_prompt: bool = True, request_id: str = "",
                    timeout: float | None = None, **sampling) -> Iterator[Delta]:
        req = build_request(chat=messages, add_generation_prompt=add_generation_prompt, request_id=request_id,
                            **sampling)
        return self._stream(req, timeout)

    def upload(self, data: bytes, filename: str = "", timeout: float | None = None) -> serve_pb2.UploadedMedia:
        """Upload one image, encoded at once; pass `FileId(result.file_id)` as an image later."""
        return self._call(self._stub.UploadMedia, serve_pb2.UploadMediaRequest(data=data, filename=filename), timeout)

    def get_upload(self, file_id: str) -> serve_pb2.UploadedMedia:
        return self._call(self._stub.GetUpload, serve_pb2.UploadRef(file_id=file_id), None)

    def delete_upload(self, file_id: str) -> bool:
        """Forget an upload (its features leave the MM Store)."""
        return self._call(self._stub.DeleteUpload, serve_pb2.UploadRef(file_id=file_id), None).deleted

    def abort(self, request_id: str) -> bool:
        return self._call(self._stub.Abort, serve_pb2.AbortRequest(request_id=request_id), None).found

    def model_info(self) -> serve_pb2.ModelInfo:
        return self._call(self._stub.GetModelInfo, serve_pb2.GetModelInfoRequest(), None)

    def server_info(self) -> serve_pb2.ServerInfo:
        return self._call(self._stub.GetServerInfo, serve_pb2.GetServerInfoRequest(), None)

    def health(self, service: str = "") -> str:
        """The grpc.health.v1 status name ("SERVING", ...)."""
        stub = health_pb2_grpc.HealthStub(self._channel)
        resp = self._call(stub.Check, health_pb2.HealthCheckRequest(service=service), None)
        return health_pb2.HealthCheckResponse.ServingStatus.Name(resp.status)

    def wait_ready(self, timeout: float = 30.0) -> None:
        """Block until the channel connects (raises EPDServeError UNAVAILABLE after `timeout`)."""
        try:
            grpc.channel_ready_future(self._channel).result(timeout=timeout)
        except grpc.FutureTimeoutError:
            raise EPDServeError(grpc.StatusCode.UNAVAILABLE, f"{self.address} not reachable in {timeout} s") from None

    def close(self) -> None:
        for ch in self._channels:
            ch.close()

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def _call(self, method, req, timeout):
        try:
            return method(req, timeout=timeout if timeout is not None else self.timeout)
        except grpc.RpcError as e:
            raise EPDServeError.from_rpc(e) from None

    def _stream(self, req, timeout) -> Iterator[Delta]:
        """The request's deltas; on UNAVAILABLE, resumed on the next address (resume.Resumption)."""
        run = Resumption(req, self.retry, timeout if timeout is not None else self.timeout)
        while True:
            attempt, left = run.attempt()
            try:
                for d in self._stream_once(attempt, left):
                    run.delivered(d.token_ids)
                    yield d
                return
            except EPDServeError as e:
                wait = run.failed(e)
            self._next()
            time.sleep(wait)  # the backoff before resuming (a scheduler restarting takes seconds)

    def _stream_once(self, req, timeout) -> Iterator[Delta]:
        try:
            call = self._stub.GenerateStream(req, timeout=timeout)
        except grpc.RpcError as e:
            raise EPDServeError.from_rpc(e) from None
        try:
            for d in call:
                yield delta_from(d)
        except grpc.RpcError as e:
            raise EPDServeError.from_rpc(e) from None
        finally:
            call.cancel()  # no-op when the stream completed; aborts the request otherwise
