"""Video input (Qwen3-VL, Qwen2-VL, Qwen2.5-VL): decode (PyAV), sample frames, resize, normalize, patch.

Mirrors transformers' `Qwen3VLVideoProcessor` + `Qwen3VLProcessor` without torchvision (which
epdserve's environment cannot have): the frame sampling rule (`fps` frames per second of the
clip, clamped to [min_frames, max_frames] and to the clip's frame count, indices spread evenly
and rounded), `smart_resize` over the whole clip, the bicubic antialiased resize of uint8
frames that torchvision does (torch's native uint8 kernel), the fused rescale+normalize,
and the temporal-patch layout (an odd frame count repeats the last frame). Each temporal patch
becomes `<t seconds><|vision_start|><|video_pad|>*n<|vision_end|>` in the prompt, t the mean
time of its frames. `family="qwen2"` (Qwen2-VL, Qwen2.5-VL) follows `Qwen2VLVideoProcessor`
instead (with frame sampling on): its sampling rule (a multiple of the temporal patch, evenly
stepped indices), `smart_resize` per frame, and one run of pad tokens per video; Qwen2.5-VL's
positions also take the seconds per temporal patch (`MediaInput.seconds_per_grid`).

`VideoOptions` holds a request's sampling and pixel limits: defaults from the checkpoint's
`video_preprocessor_config.json`, a request may lower but never raise them. They are part of
the video's MM Store key (`VideoOptions.key_bytes`). Bad input raises `InvalidRequestError`
(`MediaError` for bytes that are no readable video, with PyAV's reason, no object reprs).
"""
from __future__ import annotations

import io
import json
import math
from dataclasses import dataclass, replace
from pathlib import Path

import numpy as np
import torch

from epdserve.request_errors import InvalidRequestError, MediaError, readable

MAX_DECODED_FRAMES = 100_000  # a container claiming more is refused before decoding


@dataclass(frozen=True)
class VideoOptions:
    """Frame sampling and pixel limits of one video (transformers' names and meanings)."""

    fps: float = 2.0  # frames sampled per second of video
    min_frames: int = 4
    max_frames: int = 768
    min_pixels: int = 4096  # over the whole clip (frames x height x width), as smart_resize counts
    max_pixels: int = 25165824
    patch_size: int = 16
    merge_size: int = 2
    temporal_patch_size: int = 2
    image_mean: tuple[float, ...] = (0.5, 0.5, 0.5)
    image_std: tuple[float, ...] = (0.5, 0.5, 0.5)
    rescale_factor: float = 1 / 255
    family: str = "qwen3"  # or "qwen2": whose sampling, resize and placeholder rules

    @classmethod
    def from_checkpoint(cls, model_dir, family: str = "qwen3") -> "VideoOptions | None":
        """The deployment's defaults and limits, or None when the checkpoint has no video processor
        with frame sampling on."""
        path = Path(model_dir) / "video_preprocessor_config.json"
        if not path.is_file():
            return None
        c = json.loads(path.read_text())
        if not c.get("do_sample_frames", family == "qwen3"):
            return None  # every frame of any clip: no bound epdserve could keep
        size = c.get("size") or {}
        return cls(family=family, fps=float(c.get("fps", 2.0)), min_frames=int(c.get("min_frames", 4)),
                   max_frames=int(c.get("max_frames", 768)),
                   min_pixels=int(size.get("shortest_edge", c.get("min_pixels", 4096))),
                   max_pixels=int(size.get("longest_edge", c.get("max_pixels", 25165824))),
                   patch_size=int(c.get("patch_size", 16)), merge_size=int(c.get("merge_size", 2)),
                   temporal_patch_size=int(c.get("temporal_patch_size", 2)),
                   image_mean=tuple(c.get("image_mean", (0.5,) * 3)), image_std=tuple(c.get("image_std", (0.5,) * 3)),
                   rescale_factor=float(c.get("rescale_factor", 1 / 255)))

    def for_request(self, overrides: dict | None) -> "VideoOptions":
        """These defaults with a request's `fps` / `max_frames` / `max_pixels`, bounded by them."""
        overrides = dict(overrides or {})
        unknown = set(overrides) - {"fps", "max_frames", "max_pixels"}
        if unknown:
            raise InvalidRequestError(f"unknown video option(s) {sorted(unknown)}; known: fps, max_frames, max_pixels")
        out = self
        if "fps" in overrides:
            fps = _number(overrides["fps"], "fps")
            if not 0 < fps <= 1000:
                raise InvalidRequestError(f"video fps must be in (0, 1000], got {fps}")
            out = replace(out, fps=fps)
        for name, lo in (("max_frames", self.min_frames), ("max_pixels", self.min_pixels)):
            if name in overrides:
                v = _number(overrides[name], name)
                if v != int(v) or not lo <= v <= getattr(self, name):
                    raise InvalidRequestError(
                        f"video {name} must be an integer in [{lo}, {getattr(self, name)}] (this deployment's limit), got {v}")
                out = replace(out, **{name: int(v)})
        return out

    def key_bytes(self) -> bytes:
        """What the MM Store key adds to the video's bytes: every option that changes its features."""
        return (f"video:fps={self.fps!r}:frames={self.min_frames}-{self.max_frames}:"
                f"pixels={self.min_pixels}-{self.max_pixels}").encode()


def _number(v, name: str) -> float:
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        raise InvalidRequestError(f"video option {name} must be a number, got {type(v).__name__}")
    return float(v)


@dataclass
class DecodedVideo:
    frames: np.ndarray  # [T, H, W, 3] uint8, the sampled frames
    indices: list[int]  # their indices in the clip
    fps: float  # the clip's frame rate (timestamps)
    total: int  # frames in the clip


def sample_indices(total: int, video_fps: float, opts: VideoOptions) -> list[int]:
    """Indices of the frames to keep (Qwen3VLVideoProcessor / Qwen2VLVideoProcessor.sample_frames)."""
    if opts.family == "qwen2":
        tp = opts.temporal_patch_size
        most = math.floor(min(opts.max_frames, total) / tp) * tp
        n = math.floor(min(max(total / video_fps * opts.fps, opts.min_frames), most, total) / tp) * tp
        if n < tp:
            raise InvalidRequestError(f"video has {total} frame(s); at least {tp} are needed")
        return torch.arange(0, total, total / n).int().tolist()
    n = int(total / video_fps * opts.fps)
    n = min(max(n, opts.min_frames), opts.max_frames, total)
    return np.linspace(0, total - 1, n).round().astype(int).tolist()


def decode_video(data, opts: VideoOptions, fps: float | None = None) -> DecodedVideo:
    """Container bytes (mp4, webm, ...; PyAV) or a list of frames (PIL images / HxWx3 uint8 arrays,
    `fps` their rate, default 24 as transformers assumes) → the sampled RGB frames."""
    if isinstance(data, (bytes, bytearray, memoryview)):
        frames, rate = _decode_container(bytes(data))
    elif isinstance(data, (list, tuple)):
        frames, rate = _frames_from_list(data), float(fps or 24.0)
    else:
        raise InvalidRequestError(f"a video must be container bytes or a list of frames, got {type(data).__name__}")
    total = len(frames)
    if total < opts.temporal_patch_size:
        raise InvalidRequestError(f"video has {total} frame(s); at least {opts.temporal_patch_size} are needed")
    idx = sample_indices(total, rate, opts)
    return DecodedVideo(np.stack([frames[i] for i in idx]), idx, rate, total)


def _decode_container(raw: bytes) -> tuple[list[np.ndarray], float]:
    import av

    if not raw:
        raise MediaError("is empty (0 bytes)", "the video")
    try:
        with av.open(io.BytesIO(raw)) as container:
            if not container.streams.video:
                raise InvalidRequestError("the container holds no video stream")
            stream = container.streams.video[0]
            if stream.frames > MAX_DECODED_FRAMES:
                raise InvalidRequestError(f"video has {stream.frames} frames; at most {MAX_DECODED_FRAMES} are decoded")
            rate = float(stream.average_rate or 0) or 24.0
            frames = []
            for frame in container.decode(video=0):
                frames.append(frame.to_ndarray(format="rgb24"))
                if len(frames) > MAX_DECODED_FRAMES:
                    raise InvalidRequestError(f"video has more than {MAX_DECODED_FRAMES} frames")
    except InvalidRequestError:
        raise
    except Exception as e:  # PyAV raises many types for corrupt data and unknown codecs
        raise MediaError(f"is not a readable video ({len(raw)} bytes): {readable(e)}", "the video") from None
    if not frames:
        raise InvalidRequestError("video has no decodable frames")
    return frames, rate


def _frames_from_list(items) -> list[np.ndarray]:
    from PIL import Image

    frames = []
    for i, f in enumerate(items):
        if isinstance(f, Image.Image):
            f = np.asarray(f.convert("RGB"))
        if not isinstance(f, np.ndarray) or f.dtype != np.uint8 or f.ndim != 3 or f.shape[2] != 3:
            raise InvalidRequestError(f"video frame {i} must be a PIL image or an HxWx3 uint8 array")
        frames.append(f)
    if frames and any(f.shape != frames[0].shape for f in frames):
        raise InvalidRequestError("video frames differ in size")
    return frames


def smart_resize(num_frames: int, height: int, width: int, opts: VideoOptions) -> tuple[int, int]:
    """transformers' video smart_resize: sides multiple of patch*merge, pixel budget over the clip
    (qwen3) or per frame (qwen2)."""
    factor, tf = opts.patch_size * opts.merge_size, opts.temporal_patch_size
    if opts.family == "qwen2":
        num_frames = tf = 1  # the budget is per frame
    elif height < factor or width < factor:
        scale = max(factor / height, factor / width)
        height, width = int(height * scale), int(width * scale)
    if max(height, width) / min(height, width) > 200:
        raise InvalidRequestError(f"video aspect ratio must be below 200, got {max(height, width) / min(height, width)}")
    h_bar, w_bar = round(height / factor) * factor, round(width / factor) * factor
    t_bar = round(num_frames / tf) * tf
    if t_bar * h_bar * w_bar > opts.max_pixels:
        beta = math.sqrt((num_frames * height * width) / opts.max_pixels)
        h_bar = max(factor, math.floor(height / beta / factor) * factor)
        w_bar = max(factor, math.floor(width / beta / factor) * factor)
    elif t_bar * h_bar * w_bar < opts.min_pixels:
        beta = math.sqrt(opts.min_pixels / (num_frames * height * width))
        h_bar = math.ceil(height * beta / factor) * factor
        w_bar = math.ceil(width * beta / factor) * factor
    return h_bar, w_bar


def video_pixels(frames: np.ndarray, opts: VideoOptions) -> tuple[torch.Tensor, torch.Tensor]:
    """Sampled frames [T, H, W, 3] uint8 → (pixel_values_videos [t*h*w, C*tp*p*p], grid_thw [3])."""
    video = torch.from_numpy(np.ascontiguousarray(frames)).permute(0, 3, 1, 2).contiguous()  # [T, C, H, W] uint8
    t, c, h, w = video.shape
    rh, rw = smart_resize(t, h, w, opts)
    if (rh, rw) != (h, w):  # as torchvision on CPU: the native uint8 antialiased bicubic kernel
        video = torch.nn.functional.interpolate(video, size=(rh, rw), mode="bicubic", align_corners=False,
                                                antialias=True)
    mean = torch.tensor(opts.image_mean) * (1.0 / opts.rescale_factor)
    std = torch.tensor(opts.image_std) * (1.0 / opts.rescale_factor)
    x = video.to(torch.float32).sub_(mean[:, None, None]).div_(std[:, None, None])
    tp, p, m = opts.temporal_patch_size, opts.patch_size, opts.merge_size
    if pad := -t % tp:
        x = torch.cat([x, x[-1:].expand(pad, -1, -1, -1)])
    gt, gh, gw = x.shape[0] // tp, rh // p, rw // p
    patches = x.view(gt, tp, c, gh // m, m, p, gw // m, m, p).permute(0, 3, 6, 4, 7, 2, 1, 5, 8)
    return patches.reshape(gt * gh * gw, c * tp * p * p).contiguous(), torch.tensor([gt, gh, gw])


def temporal_patch_times(indices: list[int], fps: float, temporal_patch_size: int) -> list[float]:
    """Seconds of each temporal patch: the mean time of its first and last frame (Qwen3VLProcessor)."""
    idx = list(indices)
    if pad := -len(idx) % temporal_patch_size:
        idx.extend([idx[-1]] * pad)
    ts = [i / fps for i in idx]
    return [(ts[i] + ts[i + temporal_patch_size - 1]) / 2 for i in range(0, len(ts), temporal_patch_size)]
