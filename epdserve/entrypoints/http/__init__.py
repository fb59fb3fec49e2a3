"""The OpenAI-compatible HTTP front of the scheduler (FastAPI + uvicorn, as vLLM and SGLang use).

`HttpFront` serves `/v1/chat/completions`, `/v1/completions`, `/v1/files`, `/v1/models`, `/health` and
`/metrics` on the scheduler's own event loop, calling the same `Dispatcher` the gRPC
`EPDServe` service calls; the `epdserve scheduler` command composes the two (nothing in
`epdserve.scheduler` imports this package). Modules: `options` (what the operator sets),
`protocol` (request bodies), `convert` (bodies -> `GenerateRequest`), `images` (image_url
resolution), `remote_media` (the SSRF-guarded fetcher of http(s) images) and `media_address`
(which hosts and addresses it may reach), `responses` (response and SSE chunk bodies), `logprobs` (OpenAI's logprobs objects),
`errors` (OpenAI-style JSON errors),
`validation` (a refused body as one readable 400), `tools` (tools / tool_choice, tool calls in
responses), `fence` (the Host allow-list and JSON-only POSTs, before any route), `tenancy` (the
caller's tenant, and who may read /metrics),
`files` (/v1/files: uploads encoded at upload) and `multipart` (its form bodies),
`app` (the routes), `server` (uvicorn on a running loop; also `MetricsFront`, /metrics alone).
"""
from epdserve.entrypoints.http.options import HttpOptions
from epdserve.entrypoints.http.server import HttpFront, MetricsFront

__all__ = ["HttpFront", "HttpOptions", "MetricsFront"]
