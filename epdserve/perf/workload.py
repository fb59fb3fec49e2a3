"""Seeded, offline serving workloads shaped like ShareGPT-4o.

Owns `WorkloadConfig` (the knobs), `BenchRequest` (one request as the client sends it),
`build_workload` (config → the same requests on every call), the Qwen2-VL chat prompt around one
turn (`chat_prompt`, `PLACEHOLDER`, `VIDEO_PLACEHOLDER`), `resolution_size` and `parse_mix` (a
resolution mix as the command line writes it). The named presets are perf/presets.py, the
arrival schedules perf/arrivals.py. Nothing is downloaded.

A ShareGPT-4o row is one image, a short caption instruction and a long answer (~600±140 tokens).
Here: procedural images (gradient + shapes + light noise, JPEG q85) drawn from a resolution mix,
prompts rendered with the Qwen2-VL chat template (one placeholder per image, the offline API's
convention), output lengths from a clipped normal, enforced with max_tokens + ignore_eos.
A share `video_share` of requests carries one synthetic clip instead (perf/clips.py: MP4 made
with PyAV, seeded) of a length from `video_seconds` at a resolution from `video_mix`.
"""
from __future__ import annotations

import random
import zlib
from dataclasses import asdict, dataclass, field, replace

PLACEHOLDER = "<|vision_start|><|image_pad|><|vision_end|>"
VIDEO_PLACEHOLDER = "<|vision_start|><|video_pad|><|vision_end|>"
SYSTEM = "<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n"
RESOLUTIONS = {"240p": (426, 240), "360p": (640, 360), "480p": (854, 480), "720p": (1280, 720), "1080p": (1920, 1080)}
MIN_SIDE = 56  # the demo image processor's smallest image side (one vision token)

CAPTION_INSTRUCTIONS = (
    "Describe this image in detail.",
    "Write a detailed caption for this picture.",
    "What is shown in the image? Be thorough.",
    "Explain what you see, region by region.",
    "Give a long description of the shapes and colours.",
)
VIDEO_INSTRUCTIONS = (
    "Describe what happens in this video.",
    "What moves in this clip, and where does it go?",
    "Summarise the video frame by frame.",
)


def chat_prompt(user_text: str, num_images: int = 0, num_videos: int = 0) -> str:
    """The Qwen2-VL chat template around one user turn: videos, images, then the text."""
    media = VIDEO_PLACEHOLDER * num_videos + PLACEHOLDER * num_images
    return f"{SYSTEM}<|im_start|>user\n{media}{user_text}<|im_end|>\n<|im_start|>assistant\n"


def resolution_size(name: str, scale: float = 1.0) -> tuple[int, int]:
    """'720p' or 'WxH' → (width, height), each side times `scale`, at least MIN_SIDE."""
    if name in RESOLUTIONS:
        w, h = RESOLUTIONS[name]
    else:
        try:
            w, h = (int(v) for v in name.lower().split("x"))
        except ValueError:
            raise ValueError(f"resolution must be one of {sorted(RESOLUTIONS)} or WxH, got {name!r}") from None
    return max(MIN_SIDE, round(w * scale)), max(MIN_SIDE, round(h * scale))


def parse_mix(text: str) -> dict[str, float]:
    """'360p:0.5,720p:0.3,1080p:0.2' (or '360p' alone) → {name: weight}."""
    mix = {}
    for part in (p.strip() for p in text.split(",") if p.strip()):
        name, _, weight = part.partition(":")
        mix[name.strip()] = float(weight) if weight else 1.0
    return mix


@dataclass(frozen=True)
class WorkloadConfig:
    """Every knob of a workload. Image requests carry `images_per_request` images (uniform in the
    inclusive range); a share `text_only_share` of requests carries none; each image slot reuses an
    earlier image with probability `repeated_image_share` (MM Store reuse)."""

    name: str = "sharegpt4o"
    num_requests: int = 64
    images_min: int = 1
    images_max: int = 1
    resolution_mix: tuple[tuple[str, float], ...] = (("360p", 0.5), ("720p", 0.3), ("1080p", 0.2))
    resolution_scale: float = 1.0  # multiplies both sides of every resolution (CPU scaling)
    output_len_mean: float = 600.0
    output_len_std: float = 140.0
    output_len_min: int = 1
    output_len_max: int = 1200
    text_only_share: float = 0.0
    repeated_image_share: float = 0.0
    text_prompt_words_mean: float = 150.0  # text-only requests: a ShareGPT-style question
    text_prompt_words_std: float = 50.0
    video_share: float = 0.0  # requests carrying one clip (no images, not text-only)
    video_mix: tuple[tuple[str, float], ...] = (("240p", 0.4), ("360p", 0.4), ("480p", 0.2))  # x resolution_scale
    video_seconds: tuple[float, ...] = (1.0, 2.0, 4.0)  # clip lengths, one drawn uniformly per clip
    video_fps: int = 8  # the clips' frame rate (the server samples frames at its own fps)
    seed: int = 0

    def __post_init__(self):
        if self.num_requests < 1:
            raise ValueError("num_requests must be >= 1")
        if not 0 <= self.images_min <= self.images_max:
            raise ValueError(f"need 0 <= images_min <= images_max, got {self.images_min}..{self.images_max}")
        if not 0 <= self.output_len_min <= self.output_len_max or self.output_len_max < 1:
            raise ValueError("need 0 <= output_len_min <= output_len_max, output_len_max >= 1")
        if self.output_len_std < 0 or self.text_prompt_words_std < 0:
            raise ValueError("standard deviations must be >= 0")
        for share in ("text_only_share", "repeated_image_share", "video_share"):
            if not 0.0 <= getattr(self, share) <= 1.0:
                raise ValueError(f"{share} must be in [0, 1]")
        if self.resolution_scale <= 0:
            raise ValueError("resolution_scale must be > 0")
        if self.images_max > 0 and self.text_only_share < 1:
            if not self.resolution_mix or any(w < 0 for _, w in self.resolution_mix) or \
                    sum(w for _, w in self.resolution_mix) <= 0:
                raise ValueError("resolution_mix needs at least one positive weight")
            for res, _ in self.resolution_mix:
                resolution_size(res)
        if self.video_share > 0:
            if not self.video_mix or any(w < 0 for _, w in self.video_mix) or sum(w for _, w in self.video_mix) <= 0:
                raise ValueError("video_mix needs at least one positive weight")
            for res, _ in self.video_mix:
                resolution_size(res)
            if not self.video_seconds or min(self.video_seconds) <= 0 or self.video_fps < 1:
                raise ValueError("video_seconds must be > 0 and video_fps >= 1")

    def with_(self, **changes) -> WorkloadConfig:
        for mix in ("resolution_mix", "video_mix"):
            if isinstance(changes.get(mix), dict):
                changes[mix] = tuple(changes[mix].items())
        return replace(self, **changes)

    def to_dict(self) -> dict:
        d = asdict(self)
        d["resolution_mix"] = dict(self.resolution_mix)
        d["video_mix"] = dict(self.video_mix)
        return d


@dataclass
class BenchRequest:
    request_id: str
    prompt: str  # chat-rendered, one PLACEHOLDER per image, one VIDEO_PLACEHOLDER per video
    images: list[bytes] = field(default_factory=list)
    image_labels: list[str] = field(default_factory=list)  # resolution name of each image
    repeated_images: int = 0  # how many of `images` already appeared in an earlier request
    max_tokens: int = 16
    videos: list[bytes] = field(default_factory=list)  # MP4 clips
    video_labels: list[str] = field(default_factory=list)  # "<resolution>/<seconds>s" of each clip
    turn: int | None = None  # multi-turn workloads (perf/multiturn.py): this request's turn, from 1
    # multi-turn: the (role, text) messages, media in the first user message; empty: the prompt's one turn
    chat: list[tuple[str, str]] = field(default_factory=list)

    @property
    def kind(self) -> str:
        return "video" if self.videos else "image" if self.images else "text"


def clipped_normal(rng: random.Random, mean: float, std: float, lo: float, hi: float) -> int:
    return int(min(hi, max(lo, round(rng.gauss(mean, std) if std > 0 else mean))))


def build_workload(cfg: WorkloadConfig) -> list[BenchRequest]:
    """The workload's requests, in arrival order; the same config always gives the same bytes."""
    from epdserve.model.demo_images import jpeg_bytes, procedural_image
    from epdserve.model.demo_tokenizer import demo_corpus

    rng = random.Random(cfg.seed)
    names = [n for n, _ in cfg.resolution_mix]
    weights = [w for _, w in cfg.resolution_mix]
    words = " ".join(demo_corpus(400, seed=cfg.seed + 17)).split(" ")
    pool: list[tuple[bytes, str]] = []  # every distinct image so far
    image_seed = (cfg.seed * 1_000_003 + zlib.crc32(cfg.name.encode()) * 7919) % (1 << 62)  # distinct per workload
    out = []
    for i in range(cfg.num_requests):
        video = cfg.video_share > 0 and rng.random() < cfg.video_share  # no draw without videos: same workloads
        text_only = not video and (cfg.images_max == 0 or rng.random() < cfg.text_only_share)
        max_tokens = max(1, clipped_normal(rng, cfg.output_len_mean, cfg.output_len_std,
                                           cfg.output_len_min, cfg.output_len_max))
        req = BenchRequest(request_id=f"{cfg.name}-{cfg.seed}-{i}", prompt="", max_tokens=max_tokens)
        if video:
            _add_clip(req, cfg, rng, seed=image_seed + 1_000_000 + i)
        elif text_only:
            n = max(1, clipped_normal(rng, cfg.text_prompt_words_mean, cfg.text_prompt_words_std, 1, 1e9))
            start = rng.randrange(0, max(1, len(words) - n))
            question = " ".join((words * (1 + n // len(words)))[start : start + n])
            req.prompt = chat_prompt(question + "\nPlease answer at length.")
        else:
            for _ in range(rng.randint(max(1, cfg.images_min), max(1, cfg.images_max))):
                if pool and rng.random() < cfg.repeated_image_share:
                    data, label = pool[rng.randrange(len(pool))]
                    req.repeated_images += 1
                else:
                    label = rng.choices(names, weights)[0]
                    w, h = resolution_size(label, cfg.resolution_scale)
                    data = jpeg_bytes(procedural_image(w, h, seed=image_seed + len(pool)), quality=85)
                    pool.append((data, label))
                req.images.append(data)
                req.image_labels.append(label)
            req.prompt = chat_prompt(rng.choice(CAPTION_INSTRUCTIONS), len(req.images))
        out.append(req)
    return out


def _add_clip(req: BenchRequest, cfg: WorkloadConfig, rng: random.Random, seed: int) -> None:
    from epdserve.perf.clips import synthetic_clip

    label = rng.choices([n for n, _ in cfg.video_mix], [w for _, w in cfg.video_mix])[0]
    seconds = rng.choice(cfg.video_seconds)
    w, h = resolution_size(label, cfg.resolution_scale)
    req.videos.append(synthetic_clip(w, h, max(1, round(seconds * cfg.video_fps)), cfg.video_fps, seed))
    req.video_labels.append(f"{label}/{seconds:g}s")
    req.prompt = chat_prompt(rng.choice(VIDEO_INSTRUCTIONS), num_videos=1)
