"""Video preprocessing against transformers' own pipeline (golden fixtures made with torchvision
in a side venv: tests/model/fixtures/video/make_fixtures.py), and its bad-input errors."""
import io
import json
from pathlib import Path

import numpy as np
import pytest
import torch

from epdserve.model.loader import load_checkpoint
from epdserve.model.processor import MultimodalProcessor
from epdserve.model.demo_images import procedural_image
from epdserve.model.video import VideoOptions, decode_video, sample_indices
from epdserve.request_errors import InvalidRequestError

FIXTURES = Path(__file__).parent / "fixtures" / "video"
CASES = sorted(p.stem for p in FIXTURES.glob("*.json"))
VID = "<|vision_start|><|video_pad|><|vision_end|>"


def _processor(model_dir):
    ckpt = load_checkpoint(model_dir)
    return MultimodalProcessor(ckpt.tokenizer, ckpt.image_processor, ckpt.model.config.image_token_id, 2, 4096,
                               video=ckpt.video)


@pytest.fixture(scope="module")
def processor(qwen3_vl_tiny):
    return _processor(qwen3_vl_tiny)


def case(name):
    rec = json.loads((FIXTURES / f"{name}.json").read_text())
    images = [procedural_image(w, h, s) for (w, h), s in zip(rec["image_sizes"], rec["image_seeds"])]
    return rec, images, (FIXTURES / rec["video_file"]).read_bytes()


def test_fixtures_present():
    assert set(CASES) == {"mp4_h264", "webm_vp9_odd_frames", "mp4_with_image", "qwen3_vl_moe_mp4", "qwen2_vl_mp4",
                          "qwen2_vl_webm", "qwen2_5_vl_mp4", "qwen2_5_vl_webm"}


@pytest.mark.parametrize("name", CASES)
def test_pixels_grid_and_prompt_ids_equal_transformers(request, name):
    rec, images, data = case(name)
    processor = _processor(request.getfixturevalue(f"{rec['arch']}_tiny"))
    p = processor.process(rec["prompt"], images, [data], {"fps": rec["fps"]})
    assert p.token_ids == rec["input_ids"]  # Qwen3-VL: timestamps, vision start/end per temporal patch
    video = next(m for m in p.media if m.kind == "video")
    assert video.grid_thw.tolist() == rec["video_grid_thw"][0]
    if rec["second_per_grid_ts"] is not None:  # Qwen2.5-VL
        assert torch.tensor([video.seconds_per_grid]).tolist() == rec["second_per_grid_ts"]
    want = torch.from_numpy(np.load(FIXTURES / f"{name}.npz")["pixel_values_videos"])
    assert torch.equal(video.pixel_values, want)  # bit for bit: PyAV decode, bicubic uint8 resize, normalize
    order = sorted(("image", "video"), key=lambda k: rec["prompt"].find(f"{k}_pad"))
    assert [m.kind for m in p.media] == (order if images else ["video"])  # prompt order


def test_sampling_options_are_part_of_the_key(processor):
    _, _, data = case("mp4_h264")
    a = processor.preprocess_video(data, {"fps": 2.0})
    b = processor.preprocess_video(data, {"fps": 4.0})
    c = processor.preprocess_video(data, {"fps": 2.0})
    assert a.raw == c.raw and a.raw != b.raw
    assert int(b.grid_thw[0]) > int(a.grid_thw[0])  # more frames sampled
    capped = processor.preprocess_video(data, {"fps": 4.0, "max_frames": 4})
    assert int(capped.grid_thw[0]) == 2 and capped.raw != b.raw


def test_sample_indices_rule():
    opts = VideoOptions()
    assert sample_indices(12, 8.0, opts) == [0, 4, 7, 11]  # 1.5 s at 2 fps -> 3, raised to min_frames 4
    assert sample_indices(3, 8.0, opts) == [0, 1, 2]  # never more than the clip has
    assert len(sample_indices(1000, 10.0, VideoOptions(max_frames=8))) == 8
    qwen2 = VideoOptions(family="qwen2")
    assert sample_indices(14, 6.0, qwen2) == [0, 3, 7, 10]  # 4.67 frames -> a multiple of 2: 4
    assert sample_indices(3, 8.0, qwen2) == [0, 1]


def test_list_of_frames(processor):
    frames = [np.asarray(procedural_image(64, 64, seed=i)) for i in range(6)]
    m = processor.preprocess_video(frames)
    assert m.kind == "video" and m.grid_thw.tolist() == [2, 4, 4]


def _audio_only() -> bytes:
    import av

    buf = io.BytesIO()
    with av.open(buf, mode="w", format="wav") as out:
        stream = out.add_stream("pcm_s16le", rate=8000)
        frame = av.AudioFrame.from_ndarray(np.zeros((1, 800), dtype=np.int16), format="s16", layout="mono")
        frame.sample_rate = 8000
        for packet in stream.encode(frame):
            out.mux(packet)
        for packet in stream.encode():
            out.mux(packet)
    return buf.getvalue()


@pytest.mark.parametrize("video, options, match", [
    (b"", None, "empty"),
    (b"\x00\x00\x00\x18ftypmp42" + b"garbage" * 20, None, "is not a readable video"),
    ("AUDIO", None, "no video stream"),
    ("MP4", {"max_frames": 100000}, "max_frames"),
    ("MP4", {"max_pixels": 10**12}, "max_pixels"),
    ("MP4", {"fps": -1}, "fps"),
    ("MP4", {"frames": 3}, "unknown video option"),
    ([np.zeros((64, 64, 3), np.uint8)], None, "at least 2"),
    ("not a video", None, "container bytes or a list of frames"),
])
def test_bad_video_is_invalid_request(processor, video, options, match):
    if video == "AUDIO":
        video = _audio_only()
    elif video == "MP4":
        video = case("mp4_h264")[2]
    with pytest.raises(InvalidRequestError, match=match):
        processor.process(f"look {VID}", [], [video], options)


def test_placeholder_count_mismatch(processor):
    data = case("mp4_h264")[2]
    with pytest.raises(InvalidRequestError, match="2 video placeholder.*1 video"):
        processor.process(f"{VID} and {VID}", [], [data])
    with pytest.raises(InvalidRequestError, match="0 video placeholder"):
        processor.process("no placeholder", [], [data])


def test_models_without_video_refuse_it(qwen2_vl_tiny, tmp_path):
    import shutil

    shutil.copytree(qwen2_vl_tiny, tmp_path / "m")
    (tmp_path / "m" / "video_preprocessor_config.json").unlink()  # a checkpoint without a video processor
    ckpt = load_checkpoint(tmp_path / "m")
    assert ckpt.video is None
    proc = MultimodalProcessor(ckpt.tokenizer, ckpt.image_processor, ckpt.model.config.image_token_id, 2, 4096)
    with pytest.raises(InvalidRequestError, match="does not take video"):
        proc.process(f"look {VID}", [], [case("mp4_h264")[2]])


def test_decode_rejects_frames_of_different_sizes():
    frames = [np.zeros((32, 32, 3), np.uint8), np.zeros((32, 48, 3), np.uint8)]
    with pytest.raises(InvalidRequestError, match="differ in size"):
        decode_video(frames, VideoOptions())
