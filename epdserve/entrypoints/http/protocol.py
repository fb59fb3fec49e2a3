"""Request bodies of /v1/chat/completions and /v1/completions (pydantic), OpenAI's fields plus
vLLM's extras (`top_k`, `min_p`, `ignore_eos`, `stop_token_ids`, `skip_special_tokens`, `seed`,
`return_token_ids`). Unknown fields are ignored, as vLLM does; fields whose meaning epdserve
cannot honour (n > 1, logprobs, echo, penalties, logit_bias, tools) are refused with 400 by
`unsupported`, naming the field.

Every number has a range, so one out of it is a 400 naming the field here, never a failure later
(protobuf refuses an int that overflows its field): the sampling fields the gRPC message carries
take theirs from `epdserve.rpc.ranges` (the rules the scheduler checks for both fronts); top_k
also takes vLLM's -1 (off, as 0 is); the fields only refused later have OpenAI's ranges (n and
best_of 1..128, logprobs and top_logprobs 0..20, penalties -2..2, logit_bias -100..100 by token
id); a float is finite (NaN and Infinity, which JSON parsers take, are refused). A content part's
`type` is any string here; `convert` refuses the ones epdserve does not take (`input_audio`,
...) by name.
"""
from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from epdserve.rpc import ranges as R

TokenId = Annotated[int, Field(ge=R.TOKEN_ID.lo, le=R.TOKEN_ID.hi)]
MaxTokens = Annotated[int, Field(ge=R.MAX_TOKENS.lo, le=R.MAX_TOKENS.hi)]
Penalty = Annotated[float, Field(ge=-2, le=2, allow_inf_nan=False)]
Choices = Annotated[int, Field(ge=1, le=128)]
Logprobs = Annotated[int, Field(ge=0, le=20)]


class StreamOptions(BaseModel):
    include_usage: bool = False


class SamplingFields(BaseModel):
    model_config = ConfigDict(extra="ignore")

    model: str | None = None
    max_tokens: MaxTokens | None = None
    temperature: float | None = Field(default=None, ge=R.TEMPERATURE.lo, allow_inf_nan=False)
    top_p: float | None = Field(default=None, gt=R.TOP_P.lo, le=R.TOP_P.hi, allow_inf_nan=False)
    top_k: int | None = Field(default=None, ge=-1, le=R.TOP_K.hi)  # -1 (vLLM's) or 0: off
    min_p: float | None = Field(default=None, ge=R.MIN_P.lo, le=R.MIN_P.hi, allow_inf_nan=False)
    seed: int | None = Field(default=None, ge=R.SEED.lo, le=R.SEED.hi)
    stop: str | list[str] | None = None
    stop_token_ids: list[TokenId] | None = None
    ignore_eos: bool = False
    skip_special_tokens: bool = True
    return_token_ids: bool = False
    stream: bool = False
    stream_options: StreamOptions | None = None
    n: Choices = 1
    logprobs: Any = None  # each request's own type: chat's a bool, completions' a count
    top_logprobs: Logprobs | None = None
    presence_penalty: Penalty = 0.0
    frequency_penalty: Penalty = 0.0
    repetition_penalty: float | None = Field(default=None, gt=0, allow_inf_nan=False)  # vLLM's; 1 is off
    logit_bias: dict[TokenId, Annotated[float, Field(ge=-100, le=100, allow_inf_nan=False)]] | None = None
    user: str | None = None

    def unsupported(self) -> tuple[str, str] | None:
        """(why, the field) when this body asks for something epdserve does not do, or None."""
        if self.n != 1:
            return "n must be 1", "n"
        if self.logprobs not in (None, False, 0):
            return "logprobs are not supported", "logprobs"
        if self.top_logprobs:
            return "logprobs are not supported", "top_logprobs"
        for name in ("presence_penalty", "frequency_penalty"):
            if getattr(self, name):
                return f"{name} is not supported", name
        if self.repetition_penalty not in (None, 1.0):
            return "repetition_penalty is not supported", "repetition_penalty"
        if self.logit_bias:
            return "logit_bias is not supported", "logit_bias"
        if self.stream_options is not None and not self.stream:
            return "stream_options is only allowed with stream=true", "stream_options"
        return None


class ImageUrl(BaseModel):
    url: str
    detail: str | None = None


class FileRef(BaseModel):
    file_id: str | None = None  # an upload's id (POST /v1/files)
    model_config = ConfigDict(extra="ignore")


class ContentPart(BaseModel):
    model_config = ConfigDict(extra="ignore")

    type: str  # text, image_url, video_url, file; others are refused by name in convert
    text: str | None = None
    image_url: ImageUrl | None = None
    video_url: ImageUrl | None = None  # a data: URL of a video's container bytes (mp4, webm, ...)
    file: FileRef | None = None  # OpenAI's file part: {"file": {"file_id": ...}}, an uploaded image


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="ignore")

    role: Literal["system", "user", "assistant", "developer"]
    content: str | list[ContentPart] | None = None


class ChatCompletionRequest(SamplingFields):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: MaxTokens | None = None
    logprobs: bool | None = None
    add_generation_prompt: bool = True
    tools: list[Any] | None = None

    def unsupported(self) -> tuple[str, str] | None:
        if self.tools:
            return "tools are not supported", "tools"
        return super().unsupported()


class CompletionRequest(SamplingFields):
    prompt: str | list[TokenId] | list[str] | list[list[TokenId]]  # one prompt, or a list of them (one choice each)
    logprobs: Logprobs | None = None
    echo: bool = False
    best_of: Choices | None = None
    suffix: str | None = None

    def unsupported(self) -> tuple[str, str] | None:
        if self.echo:
            return "echo is not supported", "echo"
        if self.best_of not in (None, 1):
            return "best_of must be 1", "best_of"
        if self.suffix:
            return "suffix is not supported", "suffix"
        return super().unsupported()
