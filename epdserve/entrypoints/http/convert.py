"""Request bodies → the public `GenerateRequest` the `Dispatcher` serves (the gRPC API's message),
so both fronts share validation, tokenization, routing and retries.

Defaults follow OpenAI (and vLLM): temperature 1, max_tokens up to the context's end (the
instances stop at max_model_len), top_k -1 = off, min_p 0 = off.

Numbers: what was built is checked with the scheduler's own rules (`epdserve.rpc.ranges`) under
the body's field names (`top_k`, `prompt[1][4]`: a prompt's token ids inside the model's
vocabulary), and a value protobuf refuses to hold is a 400 too, so no number reaches the
scheduler that it would refuse, and none is a 500.

Content parts: `text`, `image_url`, `video_url`, `file`; any other type is a 400 that names it
("audio input is not supported", "content part type 'x' is not supported; supported: ...").
An uploaded image (POST /v1/files) is referenced as ``image_url.url = "epdserve-file://<file
id>"`` or as OpenAI's ``{"type": "file", "file": {"file_id": "<file id>"}}``; the scheduler
resolves the id for the caller (404 when it is not the caller's, expired or deleted). Errors about media name the item as the scheduler's do ("image 2",
from 1, each kind apart), where it came from and where it sits in the body: "image 2
(image/jpeg data URL, messages[0].content[1]) is not a readable image (12 bytes): ...".
"""
from __future__ import annotations

import json
import uuid

from epdserve.engine.grammar import check as check_grammar
from epdserve.engine.structured_output import StructuredOutput
from epdserve.entrypoints.http.errors import ApiError
from epdserve.entrypoints.http.images import decode_data_url, image_bytes, source
from epdserve.entrypoints.http.options import HttpOptions
from epdserve.entrypoints.http.protocol import ChatCompletionRequest, CompletionRequest, SamplingFields
from epdserve.entrypoints.http.tools import ToolPlan, tool_turn
from epdserve.instance.sampling_wire import structured_to_proto
from epdserve.limits import InputLimits, check_structured_output
from epdserve.model.chat import unsupported_part
from epdserve.model.processor import open_image
from epdserve.request_errors import InvalidRequestError, MediaError
from epdserve.rpc import common_pb2, serve_pb2
from epdserve.rpc.ranges import RangeError, check_sampling, check_token_ids
from epdserve.scheduler.uploads import FILE_URL_SCHEME

SUPPORTED_PARTS = ("text", "image_url", "video_url", "file")  # content part types the HTTP front takes


def sampling(body: SamplingFields, max_model_len: int, max_tokens: int | None,
             structured: tuple[StructuredOutput | None, str | None] | None = None,
             max_structured_bytes: int | None = None) -> common_pb2.SamplingParams:
    """The body's sampling as the gRPC message; `structured`: (constraint, field) when the caller
    already decided it (chat's named tool_choice), else the body's own (`SamplingFields.structured`).
    `max_structured_bytes`: the scheduler's limit on the constraint's text, checked before it is
    parsed (a parse takes ~0.7 s per MB)."""
    why = body.unsupported()
    if why:
        raise ApiError(400, why[0], param=why[1])
    stop = [body.stop] if isinstance(body.stop, str) else list(body.stop or [])
    try:
        p = common_pb2.SamplingParams(
            max_tokens=max_tokens or max_model_len,
            temperature=1.0 if body.temperature is None else body.temperature,
            top_p=1.0 if body.top_p is None else body.top_p,
            top_k=max(0, body.top_k or 0), stop=stop, stop_token_ids=list(body.stop_token_ids or []),
            ignore_eos=body.ignore_eos, skip_special_tokens=body.skip_special_tokens, min_p=body.min_p or 0.0,
        )
        if body.seed is not None:
            p.seed = body.seed
        for name in ("presence_penalty", "frequency_penalty"):
            if getattr(body, name):
                setattr(p, name, getattr(body, name))
        if body.repetition_penalty not in (None, 1.0):
            p.repetition_penalty = body.repetition_penalty
        p.logit_bias.update(body.logit_bias or {})
        if body.num_logprobs() is not None:
            p.logprobs = body.num_logprobs()
        check_sampling(p, prefix="")
    except RangeError as e:
        raise ApiError(400, e.message, param=e.field) from None
    except (ValueError, TypeError) as e:  # protobuf: a number its field cannot hold
        raise ApiError(400, f"a sampling parameter is out of range: {e}") from None
    constraint = field = None
    try:
        constraint, field = structured or body.structured()
        if constraint is not None:
            p.structured.CopyFrom(structured_to_proto(constraint))
            if max_structured_bytes is not None:  # the scheduler's own check (limits.py), before any parse
                check_structured_output(p.structured, InputLimits(max_structured_output_bytes=max_structured_bytes))
            check_grammar(constraint)  # the scheduler checks it too; here the 400 names the field
    except (ValueError, InvalidRequestError) as e:  # LimitError is a ValueError
        raise ApiError(400, str(e), param=field or _structured_field(body)) from None
    return p


def _structured_field(body: SamplingFields) -> str:
    """The field a refused structured output came from (the first one set)."""
    names = ("response_format", "structured_outputs", "guided_json", "guided_regex", "guided_choice", "guided_grammar")
    return next((n for n in names if getattr(body, n) is not None), "response_format")


async def chat_request(body: ChatCompletionRequest, opts: HttpOptions, max_model_len: int,
                       max_structured_bytes: int | None = None
                       ) -> tuple[list[serve_pb2.GenerateRequest], ToolPlan | None]:
    """The request, as one per choice (`n`; rpc/choices.py), and its tool plan
    (entrypoints/http/tools.py; None without tools)."""
    try:
        plan = ToolPlan.of(body.tools, body.tool_choice)
    except ValueError as e:
        raise ApiError(400, e.args[0], param=e.args[1]) from None
    if plan is not None and body.n > 1:  # one tool-call parser per response (responses.Shape)
        raise ApiError(400, "n > 1 is not supported with tools", param="n")
    chat = serve_pb2.Chat(add_generation_prompt=body.add_generation_prompt)
    if plan is not None:
        chat.tools_json = json.dumps(plan.tools)
    images = videos = 0  # numbered from 1 in prompt order, as the scheduler's errors number them
    for i, msg in enumerate(body.messages):
        role = "system" if msg.role == "developer" else msg.role
        content = msg.content if msg.content is not None else ""
        if role == "tool" or msg.tool_calls:
            if not isinstance(content, str):
                content = "".join(p.text or "" for p in content if p.type == "text")
            role, content = tool_turn(role, content, msg.tool_calls)
        out = chat.messages.add(role=role)
        if isinstance(content, str):
            out.content.add(text=content)
            continue
        for j, part in enumerate(content):
            where = f"messages[{i}].content[{j}]"
            if part.type == "text":
                out.content.add(text=part.text or "")
            elif part.type == "video_url":
                videos += 1
                out.content.add(video=_video(part, where, f"video {videos}", opts))
            elif part.type == "image_url":
                images += 1
                out.content.add(image=await _image(part, where, f"image {images}", opts))
            elif part.type == "file":
                images += 1
                out.content.add(image=_file(part, where))
            else:
                why = unsupported_part(part.type, SUPPORTED_PARTS)
                raise ApiError(400, f"{where}: {why}", param=f"{where}.type")
    structured = None
    if plan is not None and plan.named is not None:
        try:
            asked, field = body.structured()
        except ValueError as e:
            raise ApiError(400, str(e), param=_structured_field(body)) from None
        if asked is not None:
            raise ApiError(400, f"a named tool_choice is a structured output already; drop {field}", param=field)
        structured = (plan.constraint(), "tool_choice")
    one = serve_pb2.GenerateRequest(
        request_id=f"chatcmpl-{uuid.uuid4().hex}", chat=chat,
        sampling=sampling(body, max_model_len, body.max_completion_tokens or body.max_tokens, structured,
                          max_structured_bytes),
        cache_salt=body.cache_salt or "",
    )
    if body.n > 1:  # one request, its n choices one sequence group (read apart by rpc/choice_streams.py)
        one.sampling.n = body.n
    return [one], plan


async def _image(part, where: str, label: str, opts: HttpOptions) -> common_pb2.Media:
    """An `image_url` part's bytes; refused (400, naming the image, where it is and where it came
    from) when they are no image at all (the header alone is read here: the scheduler decodes it)."""
    if part.image_url is None:
        raise ApiError(400, f"{where}: an image_url part needs image_url.url", param=f"{where}.image_url")
    url = part.image_url.url
    if url.startswith(FILE_URL_SCHEME):
        return common_pb2.Media(file_id=url[len(FILE_URL_SCHEME):])
    name = f"{label} ({source(url)}, {where})"
    data = await image_bytes(url, opts, name)
    try:
        open_image(data).close()
    except MediaError as e:
        raise ApiError(400, str(e.naming(name)), param=f"{where}.image_url") from None
    return common_pb2.Media(data=data)


def _file(part, where: str) -> common_pb2.Media:
    """A `file` part: an uploaded image by id (the scheduler resolves it for this caller)."""
    if part.file is None or not part.file.file_id:
        raise ApiError(400, f"{where}: file input is supported only as an uploaded image's file.file_id "
                            "(POST /v1/files)", param=f"{where}.type")
    return common_pb2.Media(file_id=part.file.file_id)


def _video(part, where: str, label: str, opts: HttpOptions) -> common_pb2.Media:
    """A `video_url` part: only data: URLs (no fetching of videos), bounded by the body's size;
    sampled with the model's video defaults."""
    if part.video_url is None or not part.video_url.url.startswith("data:"):
        raise ApiError(400, f"{where}: a video_url part needs a data: URL in video_url.url", param=f"{where}.video_url")
    url = part.video_url.url
    data = decode_data_url(url, opts.max_body_bytes, f"{label} ({source(url)}, {where})")
    return common_pb2.Media(data=data, video=common_pb2.VideoSpec())


def completion_requests(body: CompletionRequest, max_model_len: int, vocab_size: int, max_prompts: int = 16,
                        max_structured_bytes: int | None = None) -> tuple[str, list[serve_pb2.GenerateRequest]]:
    """(the response id, one `GenerateRequest` per prompt, in the body's order). A prompt is a
    string or a list of token ids (each in [0, vocab_size)); `prompt` may be one prompt or a list
    of them (as OpenAI allows), each becoming its own request to the scheduler (id
    ``<response id>-<index>``), at most `max_prompts` of them (400 beyond: one call must not take
    every admission slot)."""
    prompt = body.prompt
    many = isinstance(prompt, list) and bool(prompt) and not isinstance(prompt[0], int)
    prompts = list(prompt) if many else [prompt]
    if not prompts or any(isinstance(p, list) and not p for p in prompts):
        raise ApiError(400, "prompt must not be empty", param="prompt")
    if len(prompts) > max_prompts:
        raise ApiError(400, f"{len(prompts)} prompts in one call; this server takes at most {max_prompts} "
                            f"(send the rest in further calls)", param="prompt")
    rid = f"cmpl-{uuid.uuid4().hex}"
    params = sampling(body, max_model_len, body.max_tokens, max_structured_bytes=max_structured_bytes)
    if body.n > 1:  # each prompt's n choices: one sequence group (choice index: prompt i's j-th at i * n + j)
        params.n = body.n
    reqs = []
    for i, p in enumerate(prompts):
        req = serve_pb2.GenerateRequest(request_id=rid if not many else f"{rid}-{i}", sampling=params,
                                        cache_salt=body.cache_salt or "")
        if isinstance(p, str):
            req.prompt = p
        else:
            _token_ids(req, p, f"prompt[{i}]" if many else "prompt", vocab_size)
        reqs.append(req)
    return rid, reqs


def _token_ids(req: serve_pb2.GenerateRequest, ids: list[int], name: str, vocab_size: int) -> None:
    """`ids` as `req`'s prompt; each must be in the model's vocabulary (400 naming it, e.g. ``prompt[2]``)."""
    try:
        check_token_ids(name, ids, vocab_size)
        req.prompt_token_ids.ids.extend(ids)
    except RangeError as e:
        raise ApiError(400, e.message, param=e.field) from None
    except (ValueError, TypeError) as e:  # protobuf: a token id an int32 cannot hold
        raise ApiError(400, f"{name}: a token id is out of range: {e}", param=name) from None
