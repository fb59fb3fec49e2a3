"""`OpenAIBackend`: the serving benchmark's requests through an OpenAI-compatible HTTP server
(epdserve's HTTP front, vLLM, SGLang, `transformers serve`), with the official `openai` client.

Requests have the shape `vllm bench serve --backend openai-chat` sends: one user message whose
content is a text part and ``image_url`` parts with base64 data: URLs, ``max_completion_tokens``,
temperature 0, ``ignore_eos``, ``stream`` with ``stream_options.include_usage``; so either tool
can drive either server. (One difference: the images come before the text, where the workload's
prompts put them, so the HTTP and gRPC runs of a workload send the same tokens; vLLM's tool puts
the text first.) Token counts per chunk come from ``choices[0].token_ids`` when the server returns
them (``return_token_ids``, vLLM's extra, which epdserve honours), else one token per content
chunk (what vLLM's benchmark assumes); each delta carries its text (a multi-turn history is built
from it). A multi-turn request (``BenchRequest.chat``) goes as its messages, the media in the first
user message. The last delta carries usage (completion tokens, and
``prompt_tokens_details.cached_tokens``, the prompt tokens the server served from its KV prefix
cache, as OpenAI and vLLM define it, when the server sends it).
"""
from __future__ import annotations

import base64
from collections.abc import Iterator
from types import SimpleNamespace

from epdserve.perf.workload import PLACEHOLDER, VIDEO_PLACEHOLDER, BenchRequest


def user_text(prompt: str) -> str:
    """The user's words of a chat-rendered benchmark prompt (the server renders the template)."""
    start = prompt.find("<|im_start|>user\n")
    body = prompt[start + len("<|im_start|>user\n"):] if start >= 0 else prompt
    end = body.find("<|im_end|>")
    return (body[:end] if end >= 0 else body).replace(PLACEHOLDER, "").replace(VIDEO_PLACEHOLDER, "")


def _mime(data: bytes) -> str:
    if data[:3] == b"\xff\xd8\xff":
        return "image/jpeg"
    if data[:8] == b"\x89PNG\r\n\x1a\n":
        return "image/png"
    return "image/webp" if data[8:12] == b"WEBP" else "application/octet-stream"


def chat_body(request: BenchRequest) -> dict:
    content = [{"type": "video_url", "video_url": {"url": f"data:video/mp4;base64,{base64.b64encode(v).decode()}"}}
               for v in request.videos]  # the workload's prompts put videos first, then images
    content += [{"type": "image_url", "image_url": {"url": f"data:{_mime(im)};base64,{base64.b64encode(im).decode()}"}}
                for im in request.images]
    if request.chat:
        (_, first), rest = request.chat[0], request.chat[1:]
        content.append({"type": "text", "text": first})
        messages = [{"role": "user", "content": content}] + [{"role": r, "content": t} for r, t in rest]
    else:
        content.append({"type": "text", "text": user_text(request.prompt)})
        messages = [{"role": "user", "content": content}]
    return {"messages": messages, "max_completion_tokens": request.max_tokens,
            "temperature": 0.0, "stream": True, "stream_options": {"include_usage": True}}


class OpenAIBackend:
    def __init__(self, base_url: str, model: str | None = None, api_key: str | None = None,
                 timeout_s: float | None = None, vllm_extras: bool = True):
        import openai

        self.client = openai.OpenAI(base_url=base_url.rstrip("/") + ("" if base_url.rstrip("/").endswith("/v1")
                                                                      else "/v1"),
                                    api_key=api_key or "EMPTY", max_retries=0, timeout=timeout_s or 600.0)
        self.model = model or self.client.models.list().data[0].id
        # vLLM's extra body fields; a server that refuses unknown fields (transformers serve) gets
        # none: outputs may then end at EOS, and tokens are counted one per content chunk.
        self.extra_body = {"ignore_eos": True, "return_token_ids": True} if vllm_extras else {}

    def stream(self, request: BenchRequest) -> Iterator:
        body = chat_body(request)
        stream = self.client.chat.completions.create(
            model=self.model, messages=body["messages"], max_completion_tokens=body["max_completion_tokens"],
            temperature=0.0, stream=True, stream_options={"include_usage": True},
            extra_body=self.extra_body)
        reason, usage = "", None
        try:
            for chunk in stream:
                if chunk.usage is not None:
                    usage = chunk.usage
                if not chunk.choices:
                    continue
                choice = chunk.choices[0]
                ids = (choice.model_extra or {}).get("token_ids")
                text = (choice.delta.content if choice.delta else None) or ""
                n = len(ids) if ids is not None else (1 if text else 0)
                if n or text:
                    yield SimpleNamespace(token_ids=list(ids) if ids is not None else [0] * n, text=text)
                if choice.finish_reason:
                    reason = choice.finish_reason
        finally:
            stream.close()
        if reason:
            yield SimpleNamespace(token_ids=[], finished=True, finish_reason=reason, usage=_usage(usage))

    def close(self) -> None:
        self.client.close()


def _usage(u) -> dict | None:
    if u is None:
        return None
    details = getattr(u, "prompt_tokens_details", None)
    cached = getattr(details, "cached_tokens", None)
    return {"prompt_tokens": u.prompt_tokens, "output_tokens": u.completion_tokens,
            **({"cached_tokens": cached} if cached is not None else {})}
