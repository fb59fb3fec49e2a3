"""Procedural test images for demos, tests and benchmarks.

Owns: `procedural_image` (a deterministic picture per seed: a colour gradient, a few filled
shapes, light noise) and `jpeg_bytes` (encode a PIL image as JPEG bytes).
"""
from __future__ import annotations

import io

import numpy as np
from PIL import Image, ImageDraw


def procedural_image(width: int, height: int, seed: int = 0) -> Image.Image:
    """An RGB image of `width`×`height` pixels; the same seed always gives the same pixels."""
    if not isinstance(width, int) or not isinstance(height, int) or width <= 0 or height <= 0:
        raise ValueError(f"width and height must be positive ints, got {width!r}x{height!r}")
    rng = np.random.default_rng(seed)
    c0, c1 = rng.integers(0, 256, size=(2, 3))
    angle = rng.uniform(0, 2 * np.pi)
    ys, xs = np.mgrid[0:height, 0:width].astype(np.float32)
    proj = xs * np.cos(angle) + ys * np.sin(angle)
    t = (proj - proj.min()) / max(float(np.ptp(proj)), 1.0)
    pixels = c0[None, None, :] * (1 - t[..., None]) + c1[None, None, :] * t[..., None]
    img = Image.fromarray(pixels.astype(np.uint8), "RGB")

    draw = ImageDraw.Draw(img)
    for _ in range(int(rng.integers(2, 6))):
        colour = tuple(int(v) for v in rng.integers(0, 256, size=3))
        x0, x1 = sorted(int(v) for v in rng.integers(0, width, size=2))
        y0, y1 = sorted(int(v) for v in rng.integers(0, height, size=2))
        box = (x0, y0, max(x1, x0 + 1), max(y1, y0 + 1))
        shape = int(rng.integers(0, 3))
        if shape == 0:
            draw.rectangle(box, fill=colour)
        elif shape == 1:
            draw.ellipse(box, fill=colour)
        else:
            draw.polygon([(box[0], box[3]), ((box[0] + box[2]) // 2, box[1]), (box[2], box[3])], fill=colour)

    noise = rng.normal(0.0, 6.0, size=(height, width, 3))
    out = np.clip(np.asarray(img, dtype=np.float32) + noise, 0, 255).astype(np.uint8)
    return Image.fromarray(out, "RGB")


def jpeg_bytes(img: Image.Image, quality: int = 85) -> bytes:
    """Encode `img` as JPEG (converted to RGB first) and return the bytes."""
    if not isinstance(img, Image.Image):
        raise TypeError(f"img must be a PIL.Image.Image, got {type(img).__name__}")
    if not 1 <= int(quality) <= 95:
        raise ValueError(f"quality must be in 1..95, got {quality}")
    buf = io.BytesIO()
    img.convert("RGB").save(buf, format="JPEG", quality=int(quality))
    return buf.getvalue()
