"""Response bodies and SSE chunks of the OpenAI API, built from the scheduler's `GenerateDelta`s.

`Shape` knows one endpoint's object names (chat: ``chat.completion`` / ``.chunk`` with
``message`` / ``delta``; completions: ``text_completion`` with ``text``). A /v1/completions
request with a list of prompts has one choice per prompt, ``index`` its place in the list (a
chunk carries the index of the prompt it continues); its usage is the prompts' sum. With `n`
choices a prompt's tokens count once, its choices' output tokens all (`sum_usage`). With
`return_token_ids` (vLLM's extra) each choice carries ``token_ids``: all of them in a response,
the new ones in each chunk. With logprobs asked, each choice (and each chunk, for its tokens)
carries them in OpenAI's shape (`logprobs.LogprobsFormat`). Usage puts the prompt tokens whose KV came from the prefilling
instance's prefix cache in ``prompt_tokens_details.cached_tokens`` (as vLLM and OpenAI count them).
"""
from __future__ import annotations

import json
import time
from dataclasses import dataclass, field

from epdserve.entrypoints.http.tools import ToolDeltas, ToolPlan
from epdserve.rpc import common_pb2


def usage_dict(u: common_pb2.Usage) -> dict:
    return {"prompt_tokens": u.prompt_tokens, "completion_tokens": u.output_tokens,
            "total_tokens": u.prompt_tokens + u.output_tokens,
            "prompt_tokens_details": {"cached_tokens": u.cached_tokens}}


def sum_usage(usages, n: int = 1) -> common_pb2.Usage:
    """The field-wise sum of several prompts' usage; with `n` choices per prompt (`usages` in
    choice order), a prompt's tokens count once (its first choice's, as OpenAI and vLLM count
    them), every choice's output tokens count."""
    total = common_pb2.Usage()
    for k, u in enumerate(usages):
        for f in common_pb2.Usage.DESCRIPTOR.fields:
            if k % n == 0 or f.name == "output_tokens":
                setattr(total, f.name, getattr(total, f.name) + getattr(u, f.name))
    return total


def sse(obj) -> str:
    """One server-sent event: ``data: <json>`` and a blank line (``[DONE]`` ends the stream)."""
    return f"data: {obj if isinstance(obj, str) else json.dumps(obj, separators=(',', ':'))}\n\n"


@dataclass(frozen=True)
class Choice:
    """One prompt's finished output."""

    text: str
    token_ids: list[int]
    finish_reason: str
    logprobs: list = field(default_factory=list)  # common.TokenLogprobs per token (empty: not asked)


@dataclass
class Shape:
    chat: bool
    request_id: str
    model: str
    return_token_ids: bool
    created: int = field(default_factory=lambda: int(time.time()))
    tools: ToolPlan | None = None  # chat with tools: the output's tool calls (entrypoints/http/tools.py)
    _tool_deltas: ToolDeltas | None = None
    logprobs: object = None  # a LogprobsFormat when the request asked for logprobs

    def _head(self, obj: str) -> dict:
        return {"id": self.request_id, "object": obj, "created": self.created, "model": self.model}

    def response(self, choices: list[Choice], usage: common_pb2.Usage) -> dict:
        out = []
        for index, c in enumerate(choices):
            choice = {"index": index, "finish_reason": c.finish_reason,
                      "logprobs": self._logprobs(c.token_ids, c.logprobs, index)}
            if self.chat and self.tools is not None:
                choice["message"], choice["finish_reason"] = self.tools.message(c.text, c.finish_reason)
            elif self.chat:
                choice["message"] = {"role": "assistant", "content": c.text}
            else:
                choice["text"] = c.text
            if self.return_token_ids:
                choice["token_ids"] = list(c.token_ids)
            out.append(choice)
        body = self._head("chat.completion" if self.chat else "text_completion")
        body.update(choices=out, usage=usage_dict(usage))
        return body

    def _logprobs(self, token_ids, logprobs, index: int):
        if self.logprobs is None or not logprobs:
            return None
        return self.logprobs.build(token_ids, logprobs, index)

    def chunk(self, text: str | None, token_ids: list[int], finish_reason: str | None = None,
              role: bool = False, index: int = 0, logprobs=()) -> dict:
        choice: dict = {"index": index, "finish_reason": finish_reason,
                        "logprobs": self._logprobs(token_ids, logprobs, index)}
        if self.chat:
            delta = {"role": "assistant"} if role else {}
            if text is not None:
                delta["content"] = text
            choice["delta"] = delta
        else:
            choice["text"] = text or ""
        if self.return_token_ids:
            choice["token_ids"] = list(token_ids)
        body = self._head("chat.completion.chunk" if self.chat else "text_completion")
        body["choices"] = [choice]
        return body

    def tool_chunks(self, text: str, token_ids: list[int], finish_reason: str | None) -> list[dict]:
        """A chat-with-tools stream's chunks for one delta: its content / tool_calls deltas (token
        ids ride on the first, or on an empty one), then the finish chunk when `finish_reason`."""
        if self._tool_deltas is None:
            self._tool_deltas = self.tools.stream()
        deltas = self._tool_deltas.feed(text) if text else []
        if finish_reason is not None:
            more, finish_reason = self._tool_deltas.finish(finish_reason)
            deltas += more
        if token_ids and not deltas:
            deltas = [{}]
        out = []
        for k, delta in enumerate(deltas):
            body = self.chunk(None, token_ids if k == 0 else [])
            body["choices"][0]["delta"] = delta
            out.append(body)
        if finish_reason is not None:
            out.append(self.chunk(None, [], finish_reason))
        return out

    def usage_chunk(self, usage: common_pb2.Usage) -> dict:
        body = self._head("chat.completion.chunk" if self.chat else "text_completion")
        body.update(choices=[], usage=usage_dict(usage))
        return body
