"""Offline API in vLLM's shape: `LLM(model=DIR).generate(prompts, SamplingParams(...))` and `.chat`.

A prompt is a string (or token ids) or `{"prompt": str, "multi_modal_data": {"image": [...]}}`
with `<|vision_start|><|image_pad|><|vision_end|>` once per image. Models whose checkpoint has a
video processor config with frame sampling (Qwen3-VL, Qwen2-VL, Qwen2.5-VL) also take
`"video": [...]` (container bytes such as mp4 / webm, or a list of frames, taken at 24 fps) with
`<|vision_start|><|video_pad|><|vision_end|>` once per video, and per-request sampling in
`"mm_processor_kwargs": {"fps": ..., "max_frames": ..., "max_pixels": ...}` (bounded by the
checkpoint's video processor config). A request with bad input
comes back with `.error` set and `finish_reason == "error"`; the others complete normally.
"""
from __future__ import annotations

import itertools
from dataclasses import dataclass, field

from epdserve.engine.config import EngineConfig
from epdserve.engine.llm_engine import LLMEngine
from epdserve.engine.outputs import RequestOutput
from epdserve.engine.sampling_params import SamplingParams
from epdserve.model.chat import chat_to_prompt
from epdserve.request_errors import InvalidRequestError


@dataclass
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    finish_reason: str | None
    logprobs: list | None = None  # engine.logprobs.TokenLogprob per token, when SamplingParams.logprobs is set


@dataclass
class GenerateOutput:
    request_id: str
    prompt: object
    outputs: list[CompletionOutput]
    finished: bool = True
    error: str | None = None
    num_prompt_tokens: int = 0
    num_vision_tokens: int = 0
    metrics: dict = field(default_factory=dict)


class LLM:
    def __init__(self, model: str, device: str = "auto", **engine_kwargs):
        """`engine_kwargs`: `EngineConfig` fields. Offline, nobody watches tokens arrive, so the
        step-time budget is off unless `step_budget=True` (steps then run at full size)."""
        engine_kwargs.setdefault("step_budget", False)
        self.engine = LLMEngine(EngineConfig(model=str(model), device=device, **engine_kwargs))
        self._ids = itertools.count()

    def get_tokenizer(self):
        return self.engine.tokenizer

    def generate(self, prompts, sampling_params: SamplingParams | list[SamplingParams] | None = None) -> list[GenerateOutput]:
        if isinstance(prompts, (str, dict)):
            prompts = [prompts]
        prompts = list(prompts)
        params = sampling_params if isinstance(sampling_params, list) else [sampling_params or SamplingParams()] * len(prompts)
        if len(params) != len(prompts):
            raise ValueError(f"{len(prompts)} prompts but {len(params)} SamplingParams")
        ids, failed = [], {}
        for prompt, p in zip(prompts, params):
            rid = str(next(self._ids))
            text, images, videos, video_options = _split_prompt(prompt)
            try:
                self.engine.add_request(self.engine.build_request(rid, text, images, p, videos, video_options))
            except InvalidRequestError as e:  # this request fails alone
                failed[rid] = RequestOutput.failed(rid, str(e))
            ids.append(rid)
        # one finished output per choice (SamplingParams.n; a refused request has one)
        want = {r: (1 if r in failed or p is None else p.n) for r, p in zip(ids, params)}
        done: dict[tuple[str, int], RequestOutput] = {(r, 0): o for r, o in failed.items()}
        logprobs: dict[tuple[str, int], list] = {}
        while len(done) < sum(want.values()):
            for out in self.engine.step():
                key = (out.request_id, out.index)
                logprobs.setdefault(key, []).extend(out.new_logprobs)
                if out.finished:
                    done[key] = out
        outs = []
        for r, prompt, sp in zip(ids, prompts, params):
            o = _to_generate_output(done[(r, 0)], prompt)
            o.outputs = [_completion(done[(r, j)], j) for j in range(want[r])]
            if sp is not None and sp.logprobs is not None:
                for j, c in enumerate(o.outputs):
                    c.logprobs = logprobs.get((r, j), [])
            outs.append(o)
        return outs

    def chat(self, messages, sampling_params: SamplingParams | None = None, add_generation_prompt: bool = True):
        """OpenAI-style messages (or a list of conversations); image parts as `image_url` data URLs.
        A conversation that cannot be rendered (an unsupported content part, a bad data URL) comes
        back with `.error` set, as a bad prompt to `generate` does; the others run."""
        convs = [messages] if messages and isinstance(messages[0], dict) else list(messages)
        prompts, failed = [], {}
        for i, conv in enumerate(convs):
            try:
                prompts.append(chat_to_prompt(self.engine.tokenizer, conv, add_generation_prompt))
            except InvalidRequestError as e:
                rid = str(next(self._ids))
                failed[i] = _to_generate_output(RequestOutput.failed(rid, str(e)), conv)
        served = iter(self.generate(prompts, sampling_params) if prompts else [])
        return [failed[i] if i in failed else next(served) for i in range(len(convs))]


def _split_prompt(prompt):
    """(text or token ids, images, videos, video options) of one prompt."""
    if isinstance(prompt, dict):
        mm = prompt.get("multi_modal_data") or {}
        images = mm.get("image") or []
        if not isinstance(images, list):
            images = [images]
        videos = mm.get("video") or []
        if not isinstance(videos, list) or (videos and not isinstance(videos[0], (bytes, bytearray, list, tuple))):
            videos = [videos]  # one video: its bytes, or its list of frames
        return (prompt.get("prompt", prompt.get("prompt_token_ids")), images, videos,
                prompt.get("mm_processor_kwargs"))
    return prompt, [], [], None


def _to_generate_output(out: RequestOutput, prompt) -> GenerateOutput:
    return GenerateOutput(
        request_id=out.request_id,
        prompt=prompt,
        outputs=[_completion(out, 0)],
        error=out.error,
        num_prompt_tokens=out.num_prompt_tokens,
        num_vision_tokens=out.num_vision_tokens,
        metrics=out.timings,
    )


def _completion(out: RequestOutput, index: int) -> CompletionOutput:
    return CompletionOutput(index, out.text, out.token_ids, out.finish_reason)
