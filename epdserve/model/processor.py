"""Multimodal input processing: prompt + images → token ids with expanded placeholders.

Each image is decoded (bytes or PIL), preprocessed by the checkpoint's image processor and
becomes a `MediaInput` (pixels, grid, token count, the raw bytes used for its hash key). The
single `<|image_pad|>` placeholder per image in the prompt is expanded to as many pad tokens as
the image yields after the 2×2 merge. Failures raise `InvalidRequestError` for this request only.
"""
from __future__ import annotations

import io
from dataclasses import dataclass

import torch
from PIL import Image

from epdserve.model.errors import InvalidRequestError


@dataclass
class MediaInput:
    raw: bytes  # the bytes the media key hashes
    pixel_values: torch.Tensor
    grid_thw: torch.Tensor  # [3]
    num_tokens: int


@dataclass
class ProcessedPrompt:
    token_ids: list[int]
    media: list[MediaInput]


def decode_image(image) -> tuple[Image.Image, bytes]:
    """Return (RGB image, raw bytes to hash). Raw bytes are the encoded file when given one."""
    if isinstance(image, Image.Image):
        img = image.convert("RGB")
        raw = f"{img.size[0]}x{img.size[1]}:".encode() + img.tobytes()
        return img, raw
    if isinstance(image, (bytes, bytearray, memoryview)):
        raw = bytes(image)
        try:
            img = Image.open(io.BytesIO(raw))
            img.load()
        except Exception as e:  # PIL raises many types for bad data
            raise InvalidRequestError(f"cannot decode image ({len(raw)} bytes): {e}") from None
        return img.convert("RGB"), raw
    raise InvalidRequestError(f"an image must be PIL.Image or bytes, got {type(image).__name__}")


class MultimodalProcessor:
    def __init__(self, tokenizer, image_processor, image_token_id: int, merge_size: int, max_model_len: int,
                 vocab_size: int | None = None):
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size or len(tokenizer)
        self.image_processor = image_processor
        self.image_token_id = image_token_id
        self.merge_size = merge_size
        self.max_model_len = max_model_len

    def preprocess_image(self, image) -> MediaInput:
        img, raw = decode_image(image)
        w, h = img.size
        if min(w, h) < 1:
            raise InvalidRequestError(f"image has no pixels ({w}x{h})")
        try:
            out = self.image_processor(images=[img], return_tensors="pt")
        except Exception as e:
            raise InvalidRequestError(f"image preprocessing failed ({w}x{h}): {e}") from None
        grid = out["image_grid_thw"][0]
        n = int(grid.prod()) // (self.merge_size**2)
        return MediaInput(raw=raw, pixel_values=out["pixel_values"], grid_thw=grid, num_tokens=n)

    def process(self, prompt: str | list[int], images: list | None = None) -> ProcessedPrompt:
        images = list(images or [])
        if isinstance(prompt, str):
            ids = self.tokenizer.encode(prompt, add_special_tokens=False)
        else:
            ids = [int(t) for t in prompt]
            bad = [t for t in ids if not 0 <= t < self.vocab_size]
            if bad:
                raise InvalidRequestError(f"token id {bad[0]} is outside the vocabulary [0, {self.vocab_size})")
        self.check_placeholders(ids, len(images))
        media = [self.preprocess_image(im) for im in images]
        return ProcessedPrompt(self.expand(ids, [m.num_tokens for m in media]), media)

    def check_placeholders(self, ids: list[int], num_images: int) -> None:
        n_ph = sum(1 for t in ids if t == self.image_token_id)
        if n_ph != num_images:
            raise InvalidRequestError(
                f"prompt has {n_ph} image placeholder(s) but {num_images} image(s) were given; put "
                "<|vision_start|><|image_pad|><|vision_end|> once per image"
            )

    def expand(self, ids: list[int], tokens_per_image: list[int]) -> list[int]:
        """Each image's single placeholder → its token count of pad tokens; checks the context length."""
        self.check_placeholders(ids, len(tokens_per_image))
        expanded: list[int] = []
        it = iter(tokens_per_image)
        for t in ids:
            expanded.extend([t] * next(it) if t == self.image_token_id else [t])
        if not expanded:
            raise InvalidRequestError("prompt is empty")
        if len(expanded) >= self.max_model_len:
            raise InvalidRequestError(
                f"prompt is {len(expanded)} tokens (images included); the model's context is {self.max_model_len}"
            )
        return expanded
