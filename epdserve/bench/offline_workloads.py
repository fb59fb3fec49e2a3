"""Seeded request sets for `epdserve bench offline`: text-only and one-image-per-request.

Owns `WorkloadSpec` (the few numbers that define a workload, small enough to hand to a worker
process as JSON) and `build_requests`, which turns a spec into the same `BenchRequest`s in every
process: text prompts are windows of the demo corpus cut to a seeded length in tokens; image
prompts are the chat template around one procedural JPEG (gradient + shapes + light noise).
"""
from __future__ import annotations

import random
from dataclasses import asdict, dataclass, field

WORKLOADS = ("text", "images")
DEFAULTS = {  # (requests, output tokens) per workload: the sizes of README 'Offline engine throughput'
    "text": (64, 128),
    "images": (32, 64),
}

_IMAGE_QUESTIONS = (
    "Describe this image in detail.",
    "What shapes and colours do you see?",
    "Write a long caption for this picture.",
    "Explain what is in the image, region by region.",
)


@dataclass(frozen=True)
class WorkloadSpec:
    name: str  # "text" | "images"
    num_requests: int
    output_len: int
    seed: int = 0
    min_prompt_len: int = 50  # text only, tokens
    max_prompt_len: int = 400
    image_size: int = 448  # images only, pixels per side

    def __post_init__(self):
        if self.name not in WORKLOADS:
            raise ValueError(f"workload must be one of {WORKLOADS}, got {self.name!r}")
        if self.num_requests < 1 or self.output_len < 1:
            raise ValueError("num_requests and output_len must be >= 1")
        if not 1 <= self.min_prompt_len <= self.max_prompt_len:
            raise ValueError(f"need 1 <= min_prompt_len <= max_prompt_len, got {self.min_prompt_len}..{self.max_prompt_len}")
        if self.image_size < 28:
            raise ValueError(f"image_size must be >= 28, got {self.image_size}")

    def to_dict(self) -> dict:
        return asdict(self)


@dataclass
class BenchRequest:
    """One request: `prompt` is token ids (text) or a string with one image placeholder per image."""

    prompt: list[int] | str
    images: list[bytes] = field(default_factory=list)

    def as_llm_prompt(self):
        """The prompt in `LLM.generate`'s shape."""
        if self.images:
            return {"prompt": self.prompt, "multi_modal_data": {"image": list(self.images)}}
        return list(self.prompt)


def build_requests(spec: WorkloadSpec, tokenizer) -> list[BenchRequest]:
    """The workload's requests; the same spec and tokenizer always give the same requests."""
    if spec.name == "text":
        return _text_requests(spec, tokenizer)
    return _image_requests(spec, tokenizer)


def _text_requests(spec: WorkloadSpec, tokenizer) -> list[BenchRequest]:
    from epdserve.model.demo_tokenizer import demo_corpus

    rng = random.Random(spec.seed)
    lengths = [rng.randint(spec.min_prompt_len, spec.max_prompt_len) for _ in range(spec.num_requests)]
    corpus_ids: list[int] = []
    lines = demo_corpus(max(200, spec.max_prompt_len), seed=spec.seed + 1)
    while len(corpus_ids) < 2 * spec.max_prompt_len:  # enough text for any window
        corpus_ids.extend(tokenizer.encode(" ".join(lines), add_special_tokens=False))
    out = []
    for n in lengths:
        start = rng.randrange(0, len(corpus_ids) - n)
        out.append(BenchRequest(prompt=corpus_ids[start : start + n]))
    return out


def _image_requests(spec: WorkloadSpec, tokenizer) -> list[BenchRequest]:
    from epdserve.model.demo_images import jpeg_bytes, procedural_image

    rng = random.Random(spec.seed)
    out = []
    for i in range(spec.num_requests):
        question = rng.choice(_IMAGE_QUESTIONS)
        messages = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": question}]}]
        prompt = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        image = procedural_image(spec.image_size, spec.image_size, seed=spec.seed * 100_003 + i)
        out.append(BenchRequest(prompt=prompt, images=[jpeg_bytes(image, quality=85)]))
    return out
