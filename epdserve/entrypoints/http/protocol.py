"""Request bodies of /v1/chat/completions and /v1/completions (pydantic), OpenAI's fields plus
vLLM's extras (`top_k`, `min_p`, `ignore_eos`, `stop_token_ids`, `skip_special_tokens`, `seed`,
`return_token_ids`, `repetition_penalty`, `cache_salt`). Unknown fields are ignored, as vLLM does;
fields whose meaning epdserve cannot honour (echo, suffix, best_of other than n) are refused with
400 by `unsupported`, naming the field; so is chat's `top_logprobs` without `logprobs`.

Structured outputs (`structured`): OpenAI's `response_format` (`text`, `json_object`,
`json_schema`), vLLM's `structured_outputs` ({json | json_object | regex | choice | grammar}) and
vLLM's older spelling (`guided_json`, `guided_regex`, `guided_choice`, `guided_grammar`, removed
from vLLM in v0.12 and still taken here); two of them in one body is a 400.

Every number has a range, so one out of it is a 400 naming the field here, never a failure later
(protobuf refuses an int that overflows its field): the sampling fields the gRPC message carries
take theirs from `epdserve.rpc.ranges` (the rules the scheduler checks for both fronts); top_k
also takes vLLM's -1 (off, as 0 is); n and best_of are 1..128, logprobs and top_logprobs 0..20,
penalties -2..2, logit_bias -100..100 by token id (OpenAI's ranges); a float is finite (NaN and
Infinity, which JSON parsers take, are refused). A content part's `type` is any string here; `convert` refuses the ones epdserve does not take (`input_audio`,
`file`, ...) by name.
"""
from __future__ import annotations

import json
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from epdserve.engine.structured_output import StructuredOutput
from epdserve.rpc import ranges as R

TokenId = Annotated[int, Field(ge=R.TOKEN_ID.lo, le=R.TOKEN_ID.hi)]
MaxTokens = Annotated[int, Field(ge=R.MAX_TOKENS.lo, le=R.MAX_TOKENS.hi)]
Penalty = Annotated[float, Field(ge=-2, le=2, allow_inf_nan=False)]
Choices = Annotated[int, Field(ge=1, le=128)]
Logprobs = Annotated[int, Field(ge=0, le=20)]


class StreamOptions(BaseModel):
    include_usage: bool = False


class JsonSchemaFormat(BaseModel):
    model_config = ConfigDict(extra="ignore", populate_by_name=True)

    name: str | None = None
    description: str | None = None
    schema_: dict[str, Any] | None = Field(default=None, alias="schema")
    strict: bool | None = None


class ResponseFormat(BaseModel):
    model_config = ConfigDict(extra="ignore")

    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None


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
    response_format: ResponseFormat | None = None
    structured_outputs: dict[str, Any] | None = None  # vLLM's
    guided_json: dict[str, Any] | str | None = None  # vLLM's spelling before v0.12
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None

    def structured(self) -> tuple[StructuredOutput | None, str | None]:
        """(the constraint the output follows, the field that asked for it), or (None, None).
        ValueError names what is wrong (the caller answers 400 with that field)."""
        asked = []
        if self.response_format is not None and self.response_format.type != "text":
            rf = self.response_format
            if rf.type == "json_object":
                asked.append(("response_format", StructuredOutput("json_object")))
            elif rf.json_schema is None or rf.json_schema.schema_ is None:
                raise ValueError("response_format.json_schema.schema is required for type json_schema")
            else:
                asked.append(("response_format", StructuredOutput("json", json.dumps(rf.json_schema.schema_))))
        if self.structured_outputs is not None:
            asked.append(("structured_outputs", StructuredOutput.from_options(self.structured_outputs)))
        for name, kind in (("guided_json", "json"), ("guided_regex", "regex"), ("guided_choice", "choice"),
                           ("guided_grammar", "grammar")):
            value = getattr(self, name)
            if value is not None:
                asked.append((name, StructuredOutput.from_options({kind: value})))
        if len(asked) > 1:
            raise ValueError(f"only one structured output per request; got {', '.join(n for n, _ in asked)}")
        return (asked[0][1], asked[0][0]) if asked else (None, None)
    # vLLM's: prefixes are shared only among requests of one tenant with one salt (security/tenants.py)
    cache_salt: str | None = Field(default=None, max_length=256)

    def unsupported(self) -> tuple[str, str] | None:
        """(why, the field) when this body asks for something epdserve does not do, or None."""
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

    role: Literal["system", "user", "assistant", "developer", "tool"]
    content: str | list[ContentPart] | None = None
    tool_calls: list[dict[str, Any]] | None = None  # an assistant's earlier calls
    tool_call_id: str | None = None  # a tool message: the call it answers


class ChatCompletionRequest(SamplingFields):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: MaxTokens | None = None
    logprobs: bool | None = None
    add_generation_prompt: bool = True
    tools: list[Any] | None = None  # entrypoints/http/tools.py
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None  # the model may call several tools: it always may

    def unsupported(self) -> tuple[str, str] | None:
        if self.top_logprobs and not self.logprobs:
            return "top_logprobs requires logprobs=true", "top_logprobs"
        return super().unsupported()

    def num_logprobs(self) -> int | None:
        """Top alternatives per token asked (None: no logprobs)."""
        return (self.top_logprobs or 0) if self.logprobs else None


class CompletionRequest(SamplingFields):
    prompt: str | list[TokenId] | list[str] | list[list[TokenId]]  # one prompt, or a list of them (one choice each)
    logprobs: Logprobs | None = None
    echo: bool = False
    best_of: Choices | None = None
    suffix: str | None = None

    def unsupported(self) -> tuple[str, str] | None:
        if self.echo:
            return "echo is not supported", "echo"
        if self.best_of not in (None, self.n):
            return "best_of is not supported (leave it unset, or equal to n)", "best_of"
        if self.suffix:
            return "suffix is not supported", "suffix"
        return super().unsupported()

    def num_logprobs(self) -> int | None:
        """Top alternatives per token asked (None: no logprobs)."""
        return self.logprobs
