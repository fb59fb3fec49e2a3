"""Multimodal input processing: prompt + images (+ videos) → token ids with expanded placeholders.

Each image is decoded (bytes or PIL), preprocessed by the checkpoint's image processor and
becomes a `MediaInput` (pixels, grid, token count, the raw bytes used for its hash key). The
single `<|image_pad|>` placeholder per image in the prompt is expanded to as many pad tokens as
the image yields after the 2×2 merge. A video (`model.video`) is one
`<|video_pad|>` placeholder, expanded to `<t seconds><|vision_start|><|video_pad|>*n<|vision_end|>`
per temporal patch (Qwen3-VL) or to its pad tokens (Qwen2 family); its key hashes its bytes and its
sampling options. Media are listed in prompt order.
Failures raise `InvalidRequestError` for this request only; a bad media item raises `MediaError`,
whose text names it ("image 2 is not a readable image (12 bytes): ...", counted from 1 per kind)
and says what PIL / PyAV found, never a Python object's repr (`epdserve.request_errors.readable`).
"""
from __future__ import annotations

import io
import warnings
from dataclasses import dataclass

import torch
from PIL import Image

from epdserve.request_errors import InvalidRequestError, MediaError, readable


@dataclass
class MediaInput:
    raw: bytes  # the bytes the media key hashes
    pixel_values: torch.Tensor
    grid_thw: torch.Tensor  # [3]
    num_tokens: int
    kind: str = "image"  # or "video"
    expansion: list[int] | None = None  # a video's placeholder replacement (None: num_tokens pad tokens)
    seconds_per_grid: float | None = None  # a video's seconds per temporal patch (Qwen2.5-VL's positions)


@dataclass
class ProcessedPrompt:
    token_ids: list[int]
    media: list[MediaInput]


def open_image(raw: bytes) -> Image.Image:
    """PIL's lazy image of `raw` (its header read, no pixel decoded): a cheap check that the bytes
    are an image at all. Raises `MediaError` ("the image is not a readable image ...", or that it
    declares more pixels than PIL decodes: the request's pixel limits, checked before any decode,
    say how many it may have)."""
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", Image.DecompressionBombWarning)  # our own pixel limits decide
            return Image.open(io.BytesIO(raw))
    except Image.DecompressionBombError as e:
        raise MediaError(f"declares too many pixels ({len(raw)} bytes): {readable(e)}") from None
    except Exception as e:  # PIL raises many types for bad data
        raise MediaError(f"is not a readable image ({len(raw)} bytes): {readable(e)}") from None


def decode_image(image) -> tuple[Image.Image, bytes]:
    """Return (RGB image, raw bytes to hash). Raw bytes are the encoded file when given one."""
    if isinstance(image, Image.Image):
        img = image.convert("RGB")
        raw = f"{img.size[0]}x{img.size[1]}:".encode() + img.tobytes()
        return img, raw
    if isinstance(image, (bytes, bytearray, memoryview)):
        raw = bytes(image)
        img = open_image(raw)
        try:
            img.load()
            return img.convert("RGB"), raw
        except Exception as e:  # truncated or corrupt pixel data
            raise MediaError(f"is not a readable image ({len(raw)} bytes, {img.format or 'unknown'} header): "
                             f"{readable(e)}") from None
    raise MediaError(f"must be a PIL.Image or bytes, not {type(image).__name__}")


class MultimodalProcessor:
    def __init__(self, tokenizer, image_processor, image_token_id: int, merge_size: int, max_model_len: int,
                 vocab_size: int | None = None, video=None):
        """`video`: a `model.video.VideoOptions` with the deployment's video defaults and limits
        (None: the model takes no video)."""
        self.tokenizer = tokenizer
        self.video = video
        self.video_token_id = tokenizer.convert_tokens_to_ids("<|video_pad|>") if video is not None else None
        self.vocab_size = vocab_size or len(tokenizer)
        self.image_processor = image_processor
        self.image_token_id = image_token_id
        self.merge_size = merge_size
        self.max_model_len = max_model_len

    def preprocess_image(self, image) -> MediaInput:
        img, raw = decode_image(image)
        w, h = img.size
        if min(w, h) < 1:
            raise MediaError(f"has no pixels ({w}x{h})")
        try:
            out = self.image_processor(images=[img], return_tensors="pt")
        except Exception as e:
            raise MediaError(f"cannot be preprocessed for this model ({w}x{h}): {readable(e)}") from None
        grid = out["image_grid_thw"][0]
        n = int(grid.prod()) // (self.merge_size**2)
        return MediaInput(raw=raw, pixel_values=out["pixel_values"], grid_thw=grid, num_tokens=n)

    def preprocess_video(self, video, options: dict | None = None, fps: float | None = None) -> MediaInput:
        """A video (container bytes, or a list of frames at `fps`) with per-request `options`."""
        from epdserve.model.video import decode_video, temporal_patch_times, video_pixels

        if self.video is None:
            raise InvalidRequestError("this model does not take video input")
        opts = self.video.for_request(options)
        decoded = decode_video(video, opts, fps)
        pixels, grid = video_pixels(decoded.frames, opts)
        expansion: list[int] | None = None  # Qwen2-VL: one run of pad tokens
        if opts.family == "qwen3":  # per temporal patch: its time, then its own vision start/end
            per_patch = int(grid[1] * grid[2]) // (self.merge_size**2)
            start, end = (self.tokenizer.convert_tokens_to_ids(t) for t in ("<|vision_start|>", "<|vision_end|>"))
            expansion = []
            for t in temporal_patch_times(decoded.indices, decoded.fps, opts.temporal_patch_size):
                expansion += self.tokenizer.encode(f"<{t:.1f} seconds>", add_special_tokens=False)
                expansion += [start, *[self.video_token_id] * per_patch, end]
        if isinstance(video, (bytes, bytearray, memoryview)):
            content = bytes(video)
        else:
            content = f"frames@{decoded.fps!r}:".encode() + b"".join(
                f"{f.shape}".encode() + f.tobytes() for f in decoded.frames)
        return MediaInput(raw=opts.key_bytes() + b"|" + content, pixel_values=pixels, grid_thw=grid,
                          num_tokens=int(grid.prod()) // (self.merge_size**2), kind="video", expansion=expansion,
                          seconds_per_grid=opts.temporal_patch_size / (len(decoded.indices) / decoded.total * decoded.fps))

    def process(self, prompt: str | list[int], images: list | None = None, videos: list | None = None,
                video_options: dict | None = None) -> ProcessedPrompt:
        images, videos = list(images or []), list(videos or [])
        if videos or video_options or self.video is not None:
            return self._process_with_videos(prompt, images, videos, video_options)
        ids = self._ids(prompt)
        self.check_placeholders(ids, len(images))
        media = [self._numbered("image", n, self.preprocess_image, im) for n, im in enumerate(images, 1)]
        return ProcessedPrompt(self.expand(ids, [m.num_tokens for m in media]), media)

    @staticmethod
    def _numbered(kind: str, n: int, preprocess, item, *args) -> MediaInput:
        """`preprocess(item, *args)`; its error names the item (`kind` `n`: "image 2", "video 1")."""
        try:
            return preprocess(item, *args)
        except MediaError as e:
            raise e.naming(f"{kind} {n}") from None
        except InvalidRequestError as e:
            raise InvalidRequestError(f"{kind} {n}: {e}") from None

    def _process_with_videos(self, prompt, images: list, videos: list, video_options: dict | None) -> ProcessedPrompt:
        if self.video is None:
            raise InvalidRequestError("this model does not take video input")
        ids = self._ids(prompt)
        self.check_placeholders(ids, len(images))
        self.check_video_placeholders(ids, len(videos))
        media = ([self._numbered("image", n, self.preprocess_image, im) for n, im in enumerate(images, 1)]
                 + [self._numbered("video", n, self.preprocess_video, v, video_options) for n, v in enumerate(videos, 1)])
        expanded, order = self.expand_media(ids, media)
        return ProcessedPrompt(expanded, [media[i] for i in order])

    def check_video_placeholders(self, ids: list[int], num_videos: int) -> None:
        n_ph = sum(1 for t in ids if t == self.video_token_id) if self.video_token_id is not None else 0
        if n_ph != num_videos:
            raise InvalidRequestError(
                f"prompt has {n_ph} video placeholder(s) but {num_videos} video(s) were given; put "
                "<|vision_start|><|video_pad|><|vision_end|> once per video"
            )

    def expand_media(self, ids: list[int], media: list) -> tuple[list[int], list[int]]:
        """Expand each placeholder with the next media item of its kind (`.kind`, `.num_tokens`,
        `.expansion`); returns (expanded ids, `order`: the index in `media` of each placeholder's
        item, in prompt order). Checks the counts of both kinds and the context length."""
        kinds = {"image": [i for i, m in enumerate(media) if m.kind == "image"],
                 "video": [i for i, m in enumerate(media) if m.kind == "video"]}
        self.check_placeholders(ids, len(kinds["image"]))
        self.check_video_placeholders(ids, len(kinds["video"]))
        its = {k: iter(v) for k, v in kinds.items()}
        expanded, order = [], []
        for t in ids:
            kind = "image" if t == self.image_token_id else "video" if t == self.video_token_id else None
            if kind is None:
                expanded.append(t)
                continue
            i = next(its[kind])
            order.append(i)
            m = media[i]
            expanded.extend(m.expansion if m.expansion is not None else [t] * m.num_tokens)
        self._check_length(expanded)
        return expanded, order

    def _ids(self, prompt) -> list[int]:
        if isinstance(prompt, str):
            return self.tokenizer.encode(prompt, add_special_tokens=False)
        ids = [int(t) for t in prompt]
        bad = [t for t in ids if not 0 <= t < self.vocab_size]
        if bad:
            raise InvalidRequestError(f"token id {bad[0]} is outside the vocabulary [0, {self.vocab_size})")
        return ids

    def _check_length(self, expanded: list[int]) -> None:
        if not expanded:
            raise InvalidRequestError("prompt is empty")
        if len(expanded) >= self.max_model_len:
            raise InvalidRequestError(
                f"prompt is {len(expanded)} tokens (media included); the model's context is {self.max_model_len}"
            )

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
        self._check_length(expanded)
        return expanded
