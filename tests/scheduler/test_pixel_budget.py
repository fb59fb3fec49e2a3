"""Pixel budgets (issue 24, item 5): per request (`--max-request-pixels`: every image and every
decoded video frame, from their headers) and per scheduler in flight (`--max-pixels-in-flight`).

A pixel bomb (a PNG of a few KB that declares 10000x10000) and requests over the budgets are
refused before anything is decoded: the scheduler process's peak RSS (VmHWM) does not move,
while one allowed image of the same kind raises it by hundreds of MB. Requests beyond the
budget in flight get RESOURCE_EXHAUSTED (HTTP 429) while the admitted ones complete; the count
of pixels in flight is back to 0 after every way a request can end.
"""
from __future__ import annotations

import base64
import io
import os
import subprocess
import sys
import threading
from pathlib import Path

import grpc
import pytest
from PIL import Image

from epdserve import Client
from epdserve.client import EPDServeError
from epdserve.limits import InputLimits, LimitError, check_generate_request, video_header
from epdserve.rpc import common_pb2, serve_pb2
from tests.entrypoints.http_harness import RunningFront, post
from tests.scheduler.harness import PH, image, start_scheduler, wait_until

VIDEO_PH = "<|vision_start|><|video_pad|><|vision_end|>"
FIXTURES = Path(__file__).resolve().parents[1] / "model" / "fixtures" / "video"
MB = 1 << 20


def pixel_bomb(width: int, height: int) -> bytes:
    """A real, valid 1-bit PNG of `width` x `height` (all black): a few KB that decode to 3 bytes
    a pixel once converted to RGB."""
    out = io.BytesIO()
    Image.new("1", (width, height)).save(out, "PNG")
    return out.getvalue()


def png_url(png: bytes) -> str:
    return "data:image/png;base64," + base64.b64encode(png).decode()


def blank_video(width: int, height: int, frames: int, fps: int = 30) -> bytes:
    """An H.264 mp4 of `frames` black frames: a few KB whose header declares them all."""
    import av
    import numpy as np

    out = io.BytesIO()
    with av.open(out, "w", format="mp4") as c:
        s = c.add_stream("libx264", rate=fps)
        s.width, s.height, s.pix_fmt, s.options = width, height, "yuv420p", {"preset": "ultrafast"}
        black = av.VideoFrame.from_ndarray(np.zeros((height, width, 3), np.uint8), format="rgb24")
        for _ in range(frames):
            for packet in s.encode(black):
                c.mux(packet)
        for packet in s.encode():
            c.mux(packet)
    return out.getvalue()


def peak_rss(pid: int) -> int:
    """The process's peak resident set (VmHWM, bytes): a decode that came and went still shows."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) * 1024
    raise AssertionError("no VmHWM in /proc/<pid>/status")


def refusal(fn) -> EPDServeError:
    with pytest.raises(EPDServeError) as e:
        fn()
    return e.value


# ---------------------------------------------------------------------------------- headers only
def test_bombs_are_small_and_headers_declare_every_decoded_frame():
    assert len(pixel_bomb(10_000, 10_000)) < 16_000  # 300 MB once decoded to RGB
    assert video_header((FIXTURES / "mp4_h264.mp4").read_bytes()) == (12, 96, 72)  # frame count in the header
    assert video_header((FIXTURES / "qwen2_vl_webm.webm").read_bytes()) == (11, 84, 60)  # 2.2 s x 5 fps
    assert video_header(b"not a video") is None  # the decoder refuses it later, with its own message
    clip = blank_video(1920, 1080, 60)
    assert len(clip) < 32_000 and video_header(clip) == (60, 1920, 1080)


def _chat_video(data: bytes) -> serve_pb2.GenerateRequest:
    parts = [serve_pb2.ContentPart(video=common_pb2.Media(data=data)), serve_pb2.ContentPart(text="what happens?")]
    return serve_pb2.GenerateRequest(chat=serve_pb2.Chat(messages=[serve_pb2.ChatMessage(role="user", content=parts)]))


def test_the_request_budget_sums_images_and_video_frames():
    video = (FIXTURES / "mp4_h264.mp4").read_bytes()  # 12 x 96x72 = 82944 pixels
    req = serve_pb2.GenerateRequest(prompt=f"{PH}{VIDEO_PH}",
                                    media=[common_pb2.Media(data=image(0, 100, 100)),  # 100x100
                                           common_pb2.Media(data=video, video=common_pb2.VideoSpec())])
    assert check_generate_request(req, InputLimits()) == 100 * 100 + 82_944
    with pytest.raises(LimitError) as e:
        check_generate_request(req, InputLimits(max_request_pixels=90_000))
    assert e.value.limit == "max_request_pixels" and e.value.http_status == 400
    assert "92944 pixels" in e.value.message and "--max-request-pixels" in e.value.message
    # a chat's video part counts the same (it is a video whether or not it carries sampling options)
    assert check_generate_request(_chat_video(video), InputLimits()) == 82_944
    with pytest.raises(LimitError):
        check_generate_request(_chat_video(video), InputLimits(max_request_pixels=80_000))
    # sent by key: nothing is decoded, nothing counted
    by_key = serve_pb2.GenerateRequest(prompt=PH, media=[common_pb2.Media(key="ns:abc")])
    assert check_generate_request(by_key, InputLimits(max_request_pixels=1)) == 0


# ------------------------------------------------------------------- the scheduler as a process
@pytest.fixture(scope="module")
def scheduler_process(qwen2_vl_tiny, two_instances, tmp_path_factory):
    """`epdserve scheduler` with the default input limits, and a pixel budget in flight of 60 M."""
    tmp = tmp_path_factory.mktemp("pixel-sched")
    addr_file, log = tmp / "addr", open(tmp / "log", "w")
    proc = subprocess.Popen(
        [sys.executable, "-m", "epdserve.entrypoints.scheduler_cli", "--model", str(qwen2_vl_tiny),
         "--instance", two_instances[0].address, "--address-file", str(addr_file), "--probe-interval", "0.2",
         "--max-pixels-in-flight", "60000000"],
        stdout=log, stderr=subprocess.STDOUT, cwd=os.getcwd())
    try:
        wait_until(lambda: addr_file.exists() or proc.poll() is not None, 120, "the scheduler to serve")
        assert proc.poll() is None, (tmp / "log").read_text()[-3000:]
        with Client(addr_file.read_text(), timeout=120, retries=0) as c:
            wait_until(lambda: c.server_info().instances, 30, "the static instance")
            # every lazy import and first-call cost before the peaks are compared (PyAV's, ~16 MB, is
            # imported by the first video header read: 4 s of 720p, 110 M pixels, refused)
            c.generate(f"warm {PH}", images=[image(2)], max_tokens=2)
            e = refusal(lambda: c.generate(f"warm {VIDEO_PH}", videos=[blank_video(1280, 720, 120)], max_tokens=2))
            assert "110592000 pixels" in e.details, e.details
            yield proc, c
    finally:
        proc.terminate()
        proc.wait(30)
        log.close()


def test_pixel_bombs_are_refused_before_anything_is_decoded(scheduler_process):
    proc, c = scheduler_process
    before = peak_rss(proc.pid)
    # one image of 10000x10000 (100 M pixels, over the 25 M a single image may declare)
    e = refusal(lambda: c.generate(f"bomb {PH}", images=[pixel_bomb(10_000, 10_000)], max_tokens=2))
    assert e.code == grpc.StatusCode.INVALID_ARGUMENT and "--max-image-pixels" in e.details, e.details
    # five images of 25 M pixels each, each within its own limit: 125 M over the 100 M of one request
    e = refusal(lambda: c.generate(f"bombs {PH * 5}", images=[pixel_bomb(5000, 5000)] * 5, max_tokens=2))
    assert e.code == grpc.StatusCode.INVALID_ARGUMENT, e.details
    assert "125000000 pixels" in e.details and "--max-request-pixels" in e.details
    # three of them (75 M) fit one request but never the 60 M budget in flight: not "retry later"
    e = refusal(lambda: c.generate(f"bombs {PH * 3}", images=[pixel_bomb(5000, 5000)] * 3, max_tokens=2))
    assert e.code == grpc.StatusCode.INVALID_ARGUMENT and "--max-pixels-in-flight" in e.details, e.details
    # two seconds of 1080p: 60 decoded frames of 2 M pixels, in a ~10 KB file
    e = refusal(lambda: c.generate(f"clip {VIDEO_PH}", videos=[blank_video(1920, 1080, 60)], max_tokens=2))
    assert e.code == grpc.StatusCode.INVALID_ARGUMENT and "124416000 pixels" in e.details, e.details
    refused_growth = peak_rss(proc.pid) - before  # decoded, the smallest of these would take 75 MB (25 M x RGB)
    assert refused_growth < 20 * MB, f"the scheduler's peak RSS grew by {refused_growth / MB:.0f} MB"
    # the measurement sees a decode: one allowed 25 M-pixel image (75 MB as RGB) moves the peak
    before = peak_rss(proc.pid)
    assert c.generate(f"allowed {PH}", images=[pixel_bomb(5000, 5000)], max_tokens=2).usage.output_tokens == 2
    decoded_growth = peak_rss(proc.pid) - before
    assert decoded_growth > 75 * MB, f"peak RSS grew by only {decoded_growth / MB:.0f} MB for a decoded image"


# ----------------------------------------------------------------- the budget in flight, in-process
BIG = 5000 * 5000  # pixels of one pixel_bomb(5000, 5000): ~0.8 s to decode and resize here


@pytest.fixture(scope="module")
def budgeted(qwen2_vl_tiny, two_instances):
    """A scheduler whose budget in flight holds two big images; one preprocessing thread, so the
    second waits for the first and both stay in flight for over a second."""
    sched = start_scheduler(qwen2_vl_tiny, two_instances, preprocess_threads=1, max_pixels_in_flight=2 * BIG)
    front = RunningFront(sched)
    yield sched, front
    front.stop()
    sched.stop()


def _in_flight(sched) -> int:
    return sched.call(lambda: sched.server.dispatcher.pixels_in_flight)


def test_requests_over_the_budget_in_flight_are_exhausted_while_the_others_complete(budgeted):
    sched, front = budgeted
    bomb = pixel_bomb(5000, 5000)
    results: dict[int, object] = {}

    def send(n: int):
        with Client(sched.address, timeout=120, retries=0) as c:
            try:
                results[n] = c.generate(f"big {n} {PH}", images=[bomb], max_tokens=3)
            except EPDServeError as e:
                results[n] = e

    admitted = [threading.Thread(target=send, args=(n,)) for n in range(2)]
    for t in admitted:
        t.start()
    wait_until(lambda: _in_flight(sched) == 2 * BIG, 30, "two big requests in flight")
    with Client(sched.address, timeout=120, retries=0) as c:
        e = refusal(lambda: c.generate(f"one too many {PH}", images=[bomb], max_tokens=3))
        assert e.code == grpc.StatusCode.RESOURCE_EXHAUSTED and "pixel budget" in e.details, e.details
        status, body = post(front, "/v1/chat/completions", {
            "model": sched.server.config.model, "max_tokens": 3,
            "messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": png_url(bomb)}},
                                                      {"type": "text", "text": "and me"}]}]})
        assert status == 429 and "pixel budget" in body["error"]["message"], body
        assert _in_flight(sched) == 2 * BIG  # the refused took nothing
        assert c.generate("text needs no pixels", max_tokens=2).usage.output_tokens == 2  # 0 pixels always fit
    for t in admitted:
        t.join(120)
    assert sorted(results) == [0, 1] and all(not isinstance(r, Exception) for r in results.values()), results
    assert [r.usage.output_tokens for r in results.values()] == [3, 3]
    assert _in_flight(sched) == 0


def test_pixels_come_back_however_a_request_ends(budgeted):
    sched, front = budgeted
    with Client(sched.address, timeout=120, retries=0) as c:
        # declared in the header, then unreadable: fails in the decoder, after admission
        broken = pixel_bomb(4000, 4000)[:400]
        e = refusal(lambda: c.generate(f"broken {PH}", images=[broken], max_tokens=2))
        assert e.code == grpc.StatusCode.INVALID_ARGUMENT and "not a readable image" in e.details, e.details
        assert _in_flight(sched) == 0
        # the client gives up while the image is being decoded
        e = refusal(lambda: c.generate(f"impatient {PH}", images=[pixel_bomb(5000, 5000)], max_tokens=2, timeout=0.3))
        assert e.code == grpc.StatusCode.DEADLINE_EXCEEDED, e.details
        wait_until(lambda: _in_flight(sched) == 0, 30, "the cancelled request's pixels back")
        # streamed: given back at the first token, before the stream ends
        stream = c.generate_stream(f"streamed {PH}", images=[image(3)], max_tokens=8)
        next(stream)
        assert _in_flight(sched) == 0
        assert sum(len(d.token_ids) for d in stream) > 0
    # bigger than the whole budget in flight: INVALID_ARGUMENT (HTTP 400), never "retry later"
    three = [{"type": "image_url", "image_url": {"url": png_url(pixel_bomb(5000, 5000))}}] * 3  # 75 M > 2 x 25 M
    status, body = post(front, "/v1/chat/completions", {
        "model": sched.server.config.model, "max_tokens": 2,
        "messages": [{"role": "user", "content": [*three, {"type": "text", "text": "all three"}]}]})
    assert status == 400 and "--max-pixels-in-flight" in body["error"]["message"], body
    assert _in_flight(sched) == 0


def test_the_http_front_refuses_a_pixel_bomb_with_a_json_400(budgeted):
    sched, front = budgeted
    status, body = post(front, "/v1/chat/completions", {
        "model": sched.server.config.model, "max_tokens": 2,
        "messages": [{"role": "user", "content": [
            {"type": "image_url", "image_url": {"url": png_url(pixel_bomb(10_000, 10_000))}},
            {"type": "text", "text": "boom"}]}]})
    assert status == 400 and body["error"]["type"] == "BadRequestError", body
    assert "10000x10000" in body["error"]["message"] and "--max-image-pixels" in body["error"]["message"]
    assert _in_flight(sched) == 0
