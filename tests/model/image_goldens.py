"""The image golden fixtures (tests/model/fixtures/image, made by its make_fixtures.py with Hugging
Face's own processor and `generate`): each case's prompt, its images as PNG bytes (lossless: the
pixels transformers saw), and the record; `checked_cases` also asserts the fixtures were made from
this very checkpoint (sha256 of its weights)."""
from __future__ import annotations

import hashlib
import io
import json
from pathlib import Path

import torch

from epdserve.model.demo_images import procedural_image

FIXTURES = Path(__file__).parent / "fixtures" / "image"
ARCHS = ("qwen2_vl", "qwen2_5_vl", "qwen3_vl", "qwen3_vl_moe")


def png(image) -> bytes:
    buf = io.BytesIO()
    image.save(buf, format="PNG")
    return buf.getvalue()


def cases(arch: str) -> list[tuple[str, list[bytes], dict]]:
    out = []
    for path in sorted(FIXTURES.glob(f"{arch}_*.json")):
        rec = json.loads(path.read_text())
        if rec["arch"] == arch:
            images = [png(procedural_image(w, h, s)) for (w, h), s in zip(rec["image_sizes"], rec["image_seeds"])]
            out.append((rec["prompt"], images, rec))
    return out


def checked_cases(model_dir, arch: str) -> list[tuple[str, list[bytes], dict]]:
    got = cases(arch)
    sha = hashlib.sha256((Path(model_dir) / "model.safetensors").read_bytes()).hexdigest()
    assert len(got) == 3 and all(rec["checkpoint_sha256"] == sha for _, _, rec in got)  # the fixtures' checkpoint
    return got


def pixel_digest(pixel_values: torch.Tensor) -> str:
    """As make_fixtures.py: sha256 of the pixels as contiguous float32 bytes."""
    return hashlib.sha256(pixel_values.to(torch.float32).contiguous().numpy().tobytes()).hexdigest()
