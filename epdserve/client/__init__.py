"""epdserve.client: the Python client of the public `EPDServe` service: `Client` (blocking) and `AsyncClient` (asyncio).

    from epdserve import Client
    with Client("127.0.0.1:50051") as c:
        out = c.generate("Describe <|vision_start|><|image_pad|><|vision_end|>.", images=[jpeg],
                         max_tokens=32, temperature=0.0)
        print(out.text, out.usage.cached_vision_tokens, out.timing.ttft_s)
        for delta in c.generate_stream("Hello", max_tokens=8):
            print(delta.text, end="")
        c.chat([{"role": "user", "content": [{"type": "image", "image": jpeg}, {"type": "text", "text": "What?"}]}])

`prompt` follows the offline API's convention (one `<|vision_start|><|image_pad|><|vision_end|>`
per image, images in order); token ids work too (`prompt=[...]`). An image is bytes (an encoded
file), a PIL image (sent as PNG), a path, or `MediaKey(key)` for media already in the MM Store (or `FileId(id)` for an image uploaded with
`Client.upload`, encoded at upload)
(a previous result's `media_keys`). Chat content parts: text, `image` / `image_url`, and
`{"type": "video", "video": bytes or path, "video_options": {...}}` / `video_url` (a data: URL).
Every `SamplingParams` field is a keyword (max_tokens,
temperature, top_p, top_k, min_p, seed, stop, stop_token_ids, ignore_eos, skip_special_tokens,
presence_penalty, frequency_penalty, repetition_penalty, logit_bias={token id: bias}, and
logprobs=k: each result's / delta's `logprobs` then holds a `TokenLogprobs` per token).
OpenAI's `n`: `generate_choices(prompt, n=4, ...)` (or `chat=messages`) returns n results, the
prompt prefilled once (one request with sampling.n: a sequence group; each delta's `index` its choice).
Failures raise `EPDServeError` carrying the gRPC status code. Leaving a `generate_stream` loop
early (break, exception, close) cancels the call, which aborts the request on every instance.

A lost scheduler loses no request: give one target or several — "host:port", a gRPC target that
resolves to several schedulers ("dns:///scheduler.ns.svc:50051": a Kubernetes Service; calls are
balanced round-robin over the connected ones), or a list (`Client(["host:a", "host:b"])`,
schedulers that share the instances); a generation that fails with UNAVAILABLE is retried — on
the next target, or the same one — resuming after the tokens already received, for up to
`retry_deadline_s` (60 s) after the first failure in a row, with a capped exponential backoff
between tries (resume.py: `retry_backoff_s`, `retry_max_backoff_s`). Every call goes to the
current target, which moves on at each retry.

Modules (each imports only those listed above it, and rpc / security / engine.sampling_params /
model.chat below the package):
- messages.py: `build_request`; the results `GenerateResult`, `Delta`, `Usage`, `Timing`, `TokenLogprobs`; `EPDServeError`
- resume.py: `RetryPolicy`, and `Resumption`: the resume-and-retry loop both clients wrap
- connection.py: `SchedulerConnection`, the targets, channels (round_robin) and retry state both clients share
- sync.py: `Client`, blocking
- async_client.py: `AsyncClient`, its asyncio twin
"""
from epdserve.client.async_client import AsyncClient
from epdserve.client.messages import (
    Delta,
    EPDServeError,
    GenerateResult,
    FileId,
    MediaKey,
    Timing,
    TokenLogprobs,
    Usage,
    build_request,
)
from epdserve.client.resume import RetryPolicy
from epdserve.client.sync import Client

__all__ = ["Client", "AsyncClient", "EPDServeError", "MediaKey", "FileId", "GenerateResult", "Delta", "Usage",
           "Timing", "TokenLogprobs", "RetryPolicy", "build_request"]
