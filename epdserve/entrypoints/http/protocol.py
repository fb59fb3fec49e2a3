"""Request bodies of /v1/chat/completions and /v1/completions (pydantic), OpenAI's fields plus
vLLM's extras (`top_k`, `min_p`, `ignore_eos`, `stop_token_ids`, `skip_special_tokens`, `seed`,
`return_token_ids`). Unknown fields are ignored, as vLLM does; fields whose meaning epdserve
cannot honour (n > 1, logprobs, echo, penalties, tools) are refused with 400 by `unsupported`.
Integers are bounded to what the gRPC message holds (int32 token ids and counts, int64 seed), so
an out-of-range number is a 400 here, not a failure later. A content part's `type` is any string
here; `convert` refuses the ones epdserve does not take (`input_audio`, `file`, ...) by name.
"""
from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field

INT32_MAX = 2**31 - 1
TokenId = Annotated[int, Field(ge=0, le=INT32_MAX)]


class StreamOptions(BaseModel):
    include_usage: bool = False


class SamplingFields(BaseModel):
    model_config = ConfigDict(extra="ignore")

    model: str | None = None
    max_tokens: int | None = Field(default=None, ge=1, le=INT32_MAX)
    temperature: float | None = Field(default=None, ge=0)
    top_p: float | None = Field(default=None, gt=0, le=1)
    top_k: int | None = Field(default=None, ge=-1, le=INT32_MAX)
    min_p: float | None = Field(default=None, ge=0, le=1)
    seed: int | None = Field(default=None, ge=-(2**63), le=2**63 - 1)
    stop: str | list[str] | None = None
    stop_token_ids: list[TokenId] | None = None
    ignore_eos: bool = False
    skip_special_tokens: bool = True
    return_token_ids: bool = False
    stream: bool = False
    stream_options: StreamOptions | None = None
    n: int = 1
    logprobs: Any = None
    top_logprobs: int | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    user: str | None = None

    def unsupported(self) -> str | None:
        """Why this body asks for something epdserve does not do, or None."""
        if self.n != 1:
            return "n must be 1"
        if self.logprobs not in (None, False) or self.top_logprobs:
            return "logprobs are not supported"
        if self.presence_penalty or self.frequency_penalty:
            return "presence_penalty and frequency_penalty are not supported"
        if self.stream_options is not None and not self.stream:
            return "stream_options is only allowed with stream=true"
        return None


class ImageUrl(BaseModel):
    url: str
    detail: str | None = None


class ContentPart(BaseModel):
    model_config = ConfigDict(extra="ignore")

    type: str  # text, image_url, video_url; others are refused by name in convert
    text: str | None = None
    image_url: ImageUrl | None = None
    video_url: ImageUrl | None = None  # a data: URL of a video's container bytes (mp4, webm, ...)


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="ignore")

    role: Literal["system", "user", "assistant", "developer"]
    content: str | list[ContentPart] | None = None


class ChatCompletionRequest(SamplingFields):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(default=None, ge=1, le=INT32_MAX)
    add_generation_prompt: bool = True
    tools: list[Any] | None = None

    def unsupported(self) -> str | None:
        if self.tools:
            return "tools are not supported"
        return super().unsupported()


class CompletionRequest(SamplingFields):
    prompt: str | list[TokenId] | list[str] | list[list[TokenId]]  # one prompt, or a list of them (one choice each)
    echo: bool = False
    best_of: int | None = None
    suffix: str | None = None

    def unsupported(self) -> str | None:
        if self.echo:
            return "echo is not supported"
        if self.best_of not in (None, 1):
            return "best_of must be 1"
        if self.suffix:
            return "suffix is not supported"
        return super().unsupported()
