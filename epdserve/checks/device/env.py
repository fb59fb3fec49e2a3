"""What every part of `epdserve bench device` shares: its settings, checkpoints, prompts, clocks.

Owns `CheckConfig` (the parts' settings, passed to each part's process as JSON), `checkpoint`
(a demo checkpoint built once into the work directory and reused by later runs), the prompts
the parts send (one image, two images, text only), `timed` (median wall time of a call, the
device synchronized around it) and `PartResult` (a part's figures, rewritten to its JSON file
after every figure, so a part stopped at its timeout still reports what it measured).
"""
from __future__ import annotations

import dataclasses
import json
import os
import pathlib
import statistics
import tempfile
import time
from dataclasses import dataclass, field

PLACEHOLDER = "<|vision_start|><|image_pad|><|vision_end|>"
TEXT = ("Tell me a long story about a dragon and a knight who travel across the mountains to find the "
        "lost city.")


@dataclass
class CheckConfig:
    """The settings of one `epdserve bench device` run (flags of the command; see its --help)."""

    device: str = "cpu"
    work_dir: str = field(default_factory=lambda: os.path.join(tempfile.gettempdir(), "epdserve-device-check"))
    out_dir: str = "."
    # exact
    exact_archs: list[str] = field(default_factory=lambda: ["qwen2_vl", "qwen2_5_vl", "qwen3_vl", "qwen3_vl_moe"])
    exact_dtypes: list[str] = field(default_factory=lambda: ["float32"])
    exact_tokens: int = 24
    # serve
    modes: list[str] = field(default_factory=lambda: ["monolithic", "P-D", "E-PD", "EP-D", "ED-P", "E-P-D"])
    serve_arch: str = "qwen2_vl"
    serve_tokens: int = 16
    serve_jobs: int = 1
    kv_hop: str = "auto"
    # perf
    perf_size: str = "2b"
    perf_dtypes: list[str] = field(default_factory=lambda: ["bfloat16"])
    perf_tokens: int = 65
    perf_batch: int = 32
    perf_repeats: int = 3
    perf_served: bool = True
    perf_transformers: bool = True
    bandwidth: float | None = None  # device memory bandwidth, bytes/s (None: unknown)
    deadline_s: float = 0.0  # seconds since the epoch by which this part must be done (0: none)

    def to_json(self) -> str:
        return json.dumps(dataclasses.asdict(self))

    @classmethod
    def from_json(cls, text: str) -> CheckConfig:
        return cls(**json.loads(text))

    def left_s(self, default: float = 600.0) -> float:
        """Seconds left before this part's deadline (`default` without one)."""
        return max(1.0, self.deadline_s - time.time()) if self.deadline_s else default


def checkpoint(cfg: CheckConfig, arch: str, size: str = "tiny") -> pathlib.Path:
    """The demo checkpoint `arch`/`size` in the work directory, built on first use (the
    same arguments always give the same files, so a finished one is reused). Processes share it:
    one builds under a file lock, the others wait for it (the perf model is built in the
    background while the other parts run: `bench device`)."""
    import fcntl

    work = pathlib.Path(cfg.work_dir)
    d = work / f"{arch}-{size}"
    done = d / ".complete"
    if done.exists():
        return d
    work.mkdir(parents=True, exist_ok=True)
    with open(work / f"{arch}-{size}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # released when the file closes (or the holder dies)
        if not done.exists():
            from epdserve.model.demo import build_demo_model

            build_demo_model(d, arch=arch, size=size)
            done.write_text("built\n")
    return d


def image(width: int = 448, height: int = 336, seed: int = 0) -> bytes:
    from epdserve.model.demo_images import jpeg_bytes, procedural_image

    return jpeg_bytes(procedural_image(width, height, seed))


def prompts() -> list[tuple[str, str, list[bytes] | None]]:
    """(name, prompt, images): one image, two images, text only."""
    return [("one_image", f"Describe {PLACEHOLDER} in detail.", [image()]),
            ("two_images", f"Compare {PLACEHOLDER} and {PLACEHOLDER}.", [image(320, 240, 1), image(224, 448, 2)]),
            ("text", "Tell me a story about a dragon and a knight.", None)]


def llm_request(prompt: str, images: list[bytes] | None):
    return {"prompt": prompt, "multi_modal_data": {"image": images}} if images else prompt


def greedy(max_tokens: int):
    from epdserve import SamplingParams

    return SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)


def synchronize(device: str) -> None:
    from epdserve.platform import get_platform

    get_platform(device).synchronize()


def timed(fn, device: str, repeats: int = 3) -> float:
    """Median seconds of `fn()` over `repeats` calls, the device synchronized before and after each."""
    times = []
    for _ in range(max(1, repeats)):
        synchronize(device)
        t = time.perf_counter()
        fn()
        synchronize(device)
        times.append(time.perf_counter() - t)
    return statistics.median(times)


def free_device_memory(device: str) -> None:
    import gc

    import torch

    gc.collect()
    mod = getattr(torch, device.split(":")[0], None)
    if mod is not None and hasattr(mod, "empty_cache") and device != "cpu":
        mod.empty_cache()


def common_prefix(a: list[int], b: list[int]) -> int:
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


class PartResult:
    """A part's figures: `set` one, and the JSON file at `path` is rewritten at once (atomically)."""

    def __init__(self, part: str, path: str | os.PathLike):
        self.part, self.path = part, pathlib.Path(path)
        self.data: dict = {}
        self.write()

    def set(self, key: str, value) -> None:
        self.data[key] = value
        self.write()

    def write(self) -> None:
        tmp = self.path.with_suffix(".tmp")
        tmp.write_text(json.dumps(self.data, indent=1, default=str))
        tmp.replace(self.path)
