"""Request bodies → the public `GenerateRequest` the `Dispatcher` serves (the gRPC API's message),
so both fronts share validation, tokenization, routing and retries.

Defaults follow OpenAI (and vLLM): temperature 1, max_tokens up to the context's end (the
instances stop at max_model_len), top_k -1 = off, min_p 0 = off.
"""
from __future__ import annotations

import uuid

from epdserve.entrypoints.http.errors import ApiError
from epdserve.entrypoints.http.images import decode_data_url, image_bytes
from epdserve.entrypoints.http.options import HttpOptions
from epdserve.entrypoints.http.protocol import ChatCompletionRequest, CompletionRequest, SamplingFields
from epdserve.rpc import common_pb2, serve_pb2


def sampling(body: SamplingFields, max_model_len: int, max_tokens: int | None) -> common_pb2.SamplingParams:
    why = body.unsupported()
    if why:
        raise ApiError(400, why)
    stop = [body.stop] if isinstance(body.stop, str) else list(body.stop or [])
    p = common_pb2.SamplingParams(
        max_tokens=max_tokens or max_model_len,
        temperature=1.0 if body.temperature is None else body.temperature,
        top_p=1.0 if body.top_p is None else body.top_p,
        top_k=max(0, body.top_k or 0), stop=stop, stop_token_ids=list(body.stop_token_ids or []),
        ignore_eos=body.ignore_eos, skip_special_tokens=body.skip_special_tokens, min_p=body.min_p or 0.0,
    )
    if body.seed is not None:
        p.seed = body.seed
    return p


async def chat_request(body: ChatCompletionRequest, opts: HttpOptions, max_model_len: int) -> serve_pb2.GenerateRequest:
    chat = serve_pb2.Chat(add_generation_prompt=body.add_generation_prompt)
    for i, msg in enumerate(body.messages):
        role = "system" if msg.role == "developer" else msg.role
        out = chat.messages.add(role=role)
        content = msg.content if msg.content is not None else ""
        if isinstance(content, str):
            out.content.add(text=content)
            continue
        for part in content:
            if part.type == "text":
                out.content.add(text=part.text or "")
            elif part.type == "video_url":
                out.content.add(video=_video(part, i, opts))
            elif part.image_url is None:
                raise ApiError(400, f"messages[{i}]: an image_url part needs image_url.url", param="messages")
            else:
                out.content.add(image=common_pb2.Media(data=await image_bytes(part.image_url.url, opts)))
    return serve_pb2.GenerateRequest(
        request_id=f"chatcmpl-{uuid.uuid4().hex}", chat=chat,
        sampling=sampling(body, max_model_len, body.max_completion_tokens or body.max_tokens),
    )


def _video(part, i: int, opts: HttpOptions) -> common_pb2.Media:
    """A `video_url` part: only data: URLs (no fetching of videos), bounded by the body's size;
    sampled with the model's video defaults."""
    if part.video_url is None or not part.video_url.url.startswith("data:"):
        raise ApiError(400, f"messages[{i}]: a video_url part needs a data: URL in video_url.url", param="messages")
    return common_pb2.Media(data=decode_data_url(part.video_url.url, opts.max_body_bytes), video=common_pb2.VideoSpec())


def completion_requests(body: CompletionRequest, max_model_len: int) -> tuple[str, list[serve_pb2.GenerateRequest]]:
    """(the response id, one `GenerateRequest` per prompt, in the body's order). A prompt is a
    string or a list of token ids; `prompt` may be one prompt or a list of them (as OpenAI
    allows), each becoming its own request to the scheduler (id ``<response id>-<index>``)."""
    prompt = body.prompt
    many = isinstance(prompt, list) and bool(prompt) and not isinstance(prompt[0], int)
    prompts = list(prompt) if many else [prompt]
    if not prompts or any(isinstance(p, list) and not p for p in prompts):
        raise ApiError(400, "prompt must not be empty", param="prompt")
    rid = f"cmpl-{uuid.uuid4().hex}"
    params = sampling(body, max_model_len, body.max_tokens)
    reqs = []
    for i, p in enumerate(prompts):
        req = serve_pb2.GenerateRequest(request_id=rid if not many else f"{rid}-{i}", sampling=params)
        if isinstance(p, str):
            req.prompt = p
        else:
            req.prompt_token_ids.ids.extend(p)
        reqs.append(req)
    return rid, reqs
