"""The FastAPI app: the OpenAI routes over the scheduler's `Dispatcher`.

Before any route, `fence.Fence` refuses a Host header no one named (DNS rebinding) and a POST
body that is not JSON (415). Every /v1 route checks the API key (when one is set) before reading
the body and learns the caller's tenant (the one its key names, `caller_tenant`), reads at most
`max_body_bytes` (413 beyond; a large body is parsed off the event loop), validates it (400),
converts it to `GenerateRequest`s (one per prompt: /v1/completions takes at most
`max_prompts_per_call` prompts), each run as the caller's tenant, with its `cache_salt`; checks the scheduler's input limits
(`epdserve.limits`: 400, or 413 for a message too large) and runs them through
`SchedulerServer.generate`, the path the gRPC API takes, concurrently (with `n` choices, each
prompt is one request with sampling.n, a sequence group whose stream is read apart by choice:
rpc/choice_streams.py). A body
pydantic refuses is a 400 in one sentence (`validation.explain`). A generation request refused before that (400,
401, 404, 413) or failing there unexpectedly (500) is counted in the metrics' requests by status,
under the gRPC code of the same outcome (the scheduler's observer counts the rest, 500s
included). Errors before the first token get their HTTP status (`errors`); a stream already
answering 200 ends with an ``error`` event. Every error body is JSON in OpenAI's shape: Starlette's
own 404 (no such route) and 405 (wrong method) too, and an unexpected exception anywhere is a 500
(its type only; the traceback goes to the log, once: `errors.LastResort`), never plain text. A
client that disconnects cancels its generations, which aborts them on every instance (the
dispatcher's cancellation path); so does a failed prompt of a list its siblings. /health needs
no key; /metrics needs the scrape token (or, without one, the single API key) with `metrics_auth`,
and never a tenant's key from the keys file: its counts are every tenant's. /v1/files (files.py) uploads images, encoded at upload, that chat content references by id (a
tenant's files are its own). With metrics, every response of any route (a 401 on
/v1/models, a 404 for an unknown path, a 405) is also counted by route and HTTP status
(`epdserve.metrics.http_responses`).
"""
from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse, StreamingResponse
from pydantic import BaseModel, ValidationError
from starlette.exceptions import HTTPException

from epdserve.entrypoints.http import files
from epdserve.entrypoints.http.convert import chat_request, completion_requests
from epdserve.entrypoints.http.errors import ApiError, LastResort
from epdserve.entrypoints.http.fence import Fence, HostAllowList
from epdserve.entrypoints.http.options import PARSE_OFF_LOOP_BYTES, HttpOptions
from epdserve.entrypoints.http.tenancy import caller_tenant, http_keys, metrics_matcher
from epdserve.entrypoints.http.logprobs import LogprobsFormat
from epdserve.entrypoints.http.protocol import ChatCompletionRequest, CompletionRequest
from epdserve.entrypoints.http.responses import Choice, Shape, sse, sum_usage
from epdserve.entrypoints.http.validation import explain
from epdserve.limits import LimitError, check_generate_request
from epdserve.metrics.http_responses import CountResponses
from epdserve.rpc import serve_pb2
from epdserve.rpc.choice_streams import choice_streams
from epdserve.scheduler.errors import RequestError
from epdserve.security.secrets import bearer
from epdserve.security.tenants import DEFAULT_TENANT

log = logging.getLogger(__name__)

_DISCONNECTED = object()


async def _read_body(request: Request, limit: int) -> bytes:
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > limit:
        raise ApiError(413, f"request body larger than {limit} bytes")
    body = bytearray()
    async for chunk in request.stream():
        body += chunk
        if len(body) > limit:
            raise ApiError(413, f"request body larger than {limit} bytes")
    return bytes(body)


def _parse_now(model: type[BaseModel], raw: bytes):
    try:
        return model.model_validate_json(raw)
    except ValidationError as e:
        message, param = explain(e)
        raise ApiError(400, message, param=param) from None


async def _parse(model: type[BaseModel], raw: bytes):
    """The body as `model`; a large one in a worker thread, so that parsing it never stalls the
    event loop the scheduler and its gRPC port share."""
    if len(raw) < PARSE_OFF_LOOP_BYTES:
        return _parse_now(model, raw)
    return await asyncio.get_running_loop().run_in_executor(None, _parse_now, model, raw)


async def _race_disconnect(request: Request, aw):
    """Await `aw`; if the client disconnects first, cancel it and return `_DISCONNECTED`."""
    task = asyncio.ensure_future(aw)

    async def disconnected():
        while (await request.receive())["type"] != "http.disconnect":
            pass

    watch = asyncio.ensure_future(disconnected())
    try:
        await asyncio.wait([task, watch], return_when=asyncio.FIRST_COMPLETED)
    finally:
        watch.cancel()
        if not task.done():
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
            return _DISCONNECTED
    return task.result()


def build_app(scheduler, opts: HttpOptions, metrics=None, metrics_auth: bool = False) -> FastAPI:
    """`scheduler`: a started `SchedulerServer` (its dispatcher, config, registry). `metrics`: a
    `ServingMetrics` (or anything with `render() -> (bytes, content_type)`, `refused(status)` and
    an `http_responses` counter) served on /metrics, counting refused requests and every
    response, or None; `metrics_auth`: /metrics needs the scrape token (`opts.metrics_token`), or
    without one the single API key."""
    app = FastAPI(title="epdserve", docs_url=None, redoc_url=None, openapi_url=None)
    app.add_middleware(LastResort, log=log)  # inside CountResponses: its 500 is counted as any response
    keys = http_keys(opts)
    app.add_middleware(Fence, hosts=HostAllowList(opts.host, opts.allowed_hosts, keyed=keys is not None))
    if metrics is not None:
        app.add_middleware(CountResponses, counter=metrics.http_responses)
    model_name = opts.served_model_name or scheduler.config.model
    scrape = metrics_matcher(opts) if metrics_auth else None
    created = int(time.time())

    @app.exception_handler(ApiError)
    async def _api_error(request: Request, e: ApiError):
        return e.response()

    @app.exception_handler(HTTPException)
    async def _starlette(request: Request, e: HTTPException):  # no such route (404), wrong method (405)
        where = f"{request.method} {request.url.path}"
        if e.status_code == 404:
            message = f"no route {where}; this server serves {', '.join(_paths(app))}"
        elif e.status_code == 405:
            message = f"{where} is not allowed; use {(e.headers or {}).get('Allow', 'another method')}"
        else:
            message = f"{where}: {e.detail}"
        response = ApiError(e.status_code, message).response()
        response.headers.update(e.headers or {})
        return response

    def check(request: Request, body_model: str | None = None) -> None:
        """The API key (401), then the model the body names (404); the caller's tenant goes to
        `request.state.tenant` (`caller_tenant`)."""
        tenant = DEFAULT_TENANT if keys is None else keys.tenant_of(bearer(request.headers.get("authorization")))
        if tenant is None:
            log.warning("HTTP %s from %s refused: missing or wrong API key", request.url.path,
                        request.client.host if request.client else "?")
            raise ApiError(401, "missing or invalid API key")
        request.state.tenant = tenant
        if body_model is not None and body_model != model_name:
            raise ApiError(404, f"the model {body_model!r} does not exist; this server serves {model_name!r}",
                           param="model")

    def logprobs_format(body, chat: bool) -> LogprobsFormat | None:
        if body.num_logprobs() is None:
            return None
        return LogprobsFormat(scheduler.dispatcher.preprocessor.tokenizer, chat)

    def deadline() -> float | None:
        return None if opts.request_timeout_s is None else time.monotonic() + opts.request_timeout_s

    def max_len() -> int:
        return scheduler.dispatcher.preprocessor.max_model_len

    def count(e: ApiError) -> None:
        if metrics is not None:
            metrics.refused(e.grpc_code.name)

    def internal(what: str, e: Exception) -> ApiError:
        """A 500 for an unexpected failure while `what` (before any stream observed it): logged, counted."""
        log.error("HTTP request failed %s", what, exc_info=e)
        err = ApiError.internal(what, e)
        count(err)
        return err

    async def admitted(admit):
        """Await `admit` (everything before the scheduler); a refusal (or a 500) is counted, then raised."""
        try:
            return await admit
        except ApiError as e:
            count(e)
            raise
        except Exception as e:
            raise internal("reading the request", e) from None

    def within_limits(reqs: list[serve_pb2.GenerateRequest]) -> list[serve_pb2.GenerateRequest]:
        # the dispatcher checks them too; here a message too large is 413, not the 429 of RESOURCE_EXHAUSTED
        for req in reqs:
            try:
                check_generate_request(req, scheduler.config.limits)
            except LimitError as e:
                raise ApiError(e.http_status, e.message) from None
        return reqs

    async def serve(request: Request, reqs: list[serve_pb2.GenerateRequest], shape: Shape, stream: bool,
                    include_usage: bool, n: int = 1):
        try:
            tenant = caller_tenant(request)
            # prompt i's choice j at i * n + j (vLLM's order): one stream per request, read apart by choice
            streams = [s for req in reqs for s in choice_streams(scheduler.generate(req, deadline(), tenant), n)]
        except Exception as e:  # not started: no stream observed it
            raise internal("handing the request to the scheduler", e) from None
        try:
            firsts = await _race_disconnect(request, _firsts(streams, n))
            if firsts is _DISCONNECTED:
                await _close(streams)
                return JSONResponse({}, status_code=499)
        except BaseException:
            await _close(streams)
            raise
        if not stream:
            try:
                results = await _race_disconnect(request, _all([_collect(f, s) for f, s in zip(firsts, streams)]))
            finally:
                await _close(streams)
            if results is _DISCONNECTED:
                return JSONResponse({}, status_code=499)
            return JSONResponse(shape.response([c for c, _ in results], sum_usage([u for _, u in results], n)))
        return StreamingResponse(_events(firsts, streams, shape, include_usage, n), media_type="text/event-stream",
                                 headers={"Cache-Control": "no-cache"})

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        async def admit():
            check(request)
            body = await _parse(ChatCompletionRequest, await _read_body(request, opts.max_body_bytes))
            check(request, body.model)
            reqs, plan = await chat_request(body, opts, max_len(), scheduler.config.limits.max_structured_output_bytes)
            return body, within_limits(reqs), plan

        body, reqs, plan = await admitted(admit())
        shape = Shape(True, reqs[0].request_id, model_name, body.return_token_ids, tools=plan,
                      logprobs=logprobs_format(body, True))
        return await serve(request, reqs, shape, body.stream,
                           bool(body.stream_options and body.stream_options.include_usage), body.n)

    @app.post("/v1/completions")
    async def completions(request: Request):
        async def admit():
            check(request)
            body = await _parse(CompletionRequest, await _read_body(request, opts.max_body_bytes))
            check(request, body.model)
            rid, reqs = completion_requests(body, max_len(), scheduler.dispatcher.preprocessor.vocab_size,
                                            opts.max_prompts_per_call,
                                            scheduler.config.limits.max_structured_output_bytes)
            return body, rid, within_limits(reqs)

        body, rid, reqs = await admitted(admit())
        shape = Shape(False, rid, model_name, body.return_token_ids, logprobs=logprobs_format(body, False))
        return await serve(request, reqs, shape, body.stream,
                           bool(body.stream_options and body.stream_options.include_usage), body.n)

    files.add_routes(app, scheduler, check, admitted, _read_body, opts.max_body_bytes)

    @app.get("/v1/models")
    async def models(request: Request):
        check(request)
        return {"object": "list", "data": [{
            "id": model_name, "object": "model", "created": created, "owned_by": "epdserve",
            "max_model_len": max_len()}]}

    @app.get("/health")
    async def health():
        healthy = sum(1 for r in scheduler.registry.records() if r.routable)
        return {"status": "ok", "instances_routable": healthy}

    @app.get("/metrics")
    async def metrics_route(request: Request):
        if scrape is not None and not scrape.matches(bearer(request.headers.get("authorization"))):
            log.warning("HTTP /metrics from %s refused: missing or wrong scrape token",
                        request.client.host if request.client else "?")
            raise ApiError(401, "missing or invalid scrape token")
        if metrics is None:
            raise ApiError(404, "metrics are not enabled on this server")
        data, content_type = metrics.render()
        return PlainTextResponse(data, media_type=content_type)

    return app


def _paths(app: FastAPI) -> list[str]:
    return [r.path for r in app.routes if getattr(r, "methods", None)]


async def _all(coros):
    """Run `coros` concurrently; their results in order. The first to fail cancels the others."""
    tasks = [asyncio.ensure_future(c) for c in coros]
    try:
        return await asyncio.gather(*tasks)
    finally:
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


async def _firsts(streams: list, n: int):
    """Each stream's first delta (a prompt's n choices are one request, its streams one stream read
    apart by choice: rpc/choice_streams.py)."""
    return await _all([_next(s) for s in streams])


async def _close(streams) -> None:
    """Close every generation (one still running is aborted on its instances)."""
    await asyncio.gather(*(s.aclose() for s in streams), return_exceptions=True)


def _failure(e: Exception) -> ApiError:
    """What a generation's exception (counted by the scheduler's observer already) answers."""
    if isinstance(e, RequestError):
        return ApiError.from_grpc(e.code, e.message)
    log.error("generation failed", exc_info=e)
    return ApiError.internal("generating", e)


async def _next(deltas: AsyncIterator[serve_pb2.GenerateDelta]):
    try:
        return await deltas.__anext__()
    except Exception as e:
        raise _failure(e) from None


async def _collect(first, deltas) -> tuple[Choice, object]:
    """The whole output of one generation (read to its end: the metrics count it as ended, not cancelled)."""
    text, ids, last, lps = first.text, list(first.token_ids), first, list(first.logprobs)
    try:
        async for d in deltas:
            text += d.text
            ids.extend(d.token_ids)
            lps.extend(d.logprobs)
            last = d
    except Exception as e:
        raise _failure(e) from None
    return Choice(text, ids, last.finish_reason, lps), last.usage


async def _events(firsts, streams, shape: Shape, include_usage: bool, n: int = 1) -> AsyncIterator[str]:
    """SSE body: (chat) a role chunk, one chunk per delta (each prompt's, as they come, with its
    index), each prompt's finish chunk, then the summed usage and [DONE]. Cancelled when the
    client disconnects (starlette), which aborts every generation."""
    queue: asyncio.Queue = asyncio.Queue()

    async def pump(i: int) -> None:  # prompt i's deltas into the queue, to the stream's end; then None
        d = firsts[i]
        try:
            while True:
                await queue.put((i, d))
                d = await streams[i].__anext__()
        except StopAsyncIteration:
            pass
        except Exception as e:
            await queue.put((i, _failure(e)))
            return
        await queue.put((i, None))

    pumps = [asyncio.ensure_future(pump(i)) for i in range(len(streams))]
    usages = {}
    try:
        if shape.chat:
            for i in range(len(streams)):
                yield sse(shape.chunk("", [], role=True, index=i))
        running = len(streams)
        while running:
            i, d = await queue.get()
            if d is None:
                running -= 1
            elif isinstance(d, ApiError):
                yield sse(d.body())
                break
            else:
                if shape.tools is not None:  # chat with tools: content and tool_calls deltas (one choice)
                    for chunk in shape.tool_chunks(d.text, list(d.token_ids), d.finish_reason if d.finished else None):
                        yield sse(chunk)
                    if d.finished:
                        usages[i] = d.usage
                    continue
                if d.text or d.token_ids:
                    yield sse(shape.chunk(d.text, list(d.token_ids), index=i, logprobs=list(d.logprobs)))
                if d.finished:
                    yield sse(shape.chunk(None if shape.chat else "", [], d.finish_reason, index=i))
                    usages[i] = d.usage
        else:
            if include_usage:
                yield sse(shape.usage_chunk(sum_usage([usages[k] for k in sorted(usages)], n)))
    finally:
        for p in pumps:
            p.cancel()
        await asyncio.gather(*pumps, return_exceptions=True)
        await _close(streams)
    yield sse("[DONE]")
