"""Synthetic video clips for benchmarks: seeded frames encoded with PyAV (MPEG-4 Part 2 in MP4).

A clip is a colour gradient with a square moving across it and light noise (like the test
fixtures' clips, tests/model/fixtures/video/make_fixtures.py): cheap to make, decoded and sampled
by the server like any camera clip. The same arguments give the same bytes: the frames are
converted to yuv420p before encoding and the codec is FFmpeg's own MPEG-4 encoder (libx264 here
gave different bytes from run to run, even on one thread).
"""
from __future__ import annotations

import io

import numpy as np


def synthetic_clip(width: int, height: int, frames: int, fps: int, seed: int) -> bytes:
    """An MP4 (MPEG-4 Part 2, yuv420p) of `frames` frames of `width`x`height` (rounded down to even) at `fps`."""
    import av

    if frames < 1 or fps < 1 or width < 2 or height < 2:
        raise ValueError(f"need frames, fps >= 1 and sides >= 2, got {frames} frames {fps} fps {width}x{height}")
    width, height = width - width % 2, height - height % 2  # yuv420p
    rng = np.random.default_rng(seed)
    yy, xx = np.mgrid[0:height, 0:width]
    c0, c1 = rng.integers(0, 256, size=(2, 3))
    base = (c0 + (c1 - c0) * (xx / max(1, width - 1))[..., None]).astype(np.float32)
    buf = io.BytesIO()
    with av.open(buf, mode="w", format="mp4") as out:
        stream = out.add_stream("mpeg4", rate=fps)
        stream.width, stream.height, stream.pix_fmt = width, height, "yuv420p"
        for i in range(frames):
            img = base.copy()
            x0 = (i * width) // frames
            img[height // 4: height // 4 + max(1, height // 3), x0: x0 + max(1, width // 4)] = rng.integers(0, 256, 3)
            img += rng.normal(0, 6, size=img.shape)
            frame = av.VideoFrame.from_ndarray(np.clip(img, 0, 255).astype(np.uint8), format="rgb24")
            frame = frame.reformat(format="yuv420p")
            frame.pts = i
            for packet in stream.encode(frame):
                out.mux(packet)
        for packet in stream.encode():
            out.mux(packet)
    return buf.getvalue()
