"""The `video` workload preset: seeded MP4 clips (PyAV) at a few resolutions and lengths, the same
bytes on every build, accepted by the server's own preprocessing, sent by both bench backends."""
import io

import av
import pytest

from epdserve.bench.openai_backend import chat_body, user_text
from epdserve.perf.presets import PRESETS
from epdserve.perf.workload import PLACEHOLDER, VIDEO_PLACEHOLDER, build_workload, resolution_size

VIDEO = PRESETS["video"]


@pytest.fixture(scope="module")
def reqs():
    return build_workload(VIDEO)


def test_same_seed_same_bytes_other_seed_differs(reqs):
    again = build_workload(VIDEO)
    assert [(r.prompt, r.videos, r.video_labels, r.max_tokens) for r in reqs] == \
           [(r.prompt, r.videos, r.video_labels, r.max_tokens) for r in again]
    other = build_workload(VIDEO.with_(seed=1))
    assert [r.videos for r in other] != [r.videos for r in reqs]


def test_one_clip_per_request_at_the_drawn_resolution_and_length(reqs):
    assert len(reqs) == VIDEO.num_requests and {r.kind for r in reqs} == {"video"}
    mixes, lengths = set(), set()
    for r in reqs:
        assert len(r.videos) == len(r.video_labels) == 1 and not r.images
        assert r.prompt.count(VIDEO_PLACEHOLDER) == 1 and PLACEHOLDER not in r.prompt
        res, _, secs = r.video_labels[0].partition("/")
        seconds = float(secs.rstrip("s"))
        w, h = resolution_size(res, VIDEO.resolution_scale)
        with av.open(io.BytesIO(r.videos[0])) as c:
            frames = [f.to_ndarray(format="rgb24") for f in c.decode(video=0)]
            assert c.format.name.startswith("mov,mp4")
        assert len(frames) == round(seconds * VIDEO.video_fps) and frames[0].shape == (h - h % 2, w - w % 2, 3)
        mixes.add(res)
        lengths.add(seconds)
    assert len(mixes) > 1 and len(lengths) > 1  # a few resolutions and lengths


def test_the_server_preprocesses_the_clips(qwen2_vl_tiny, reqs):
    from epdserve.scheduler.preprocess import RequestPreprocessor

    proc = RequestPreprocessor(qwen2_vl_tiny).processor
    for r in reqs[:3]:
        out = proc.process(r.prompt, [], r.videos)
        assert [m.kind for m in out.media] == ["video"] and out.media[0].num_tokens > 0


def test_openai_backend_sends_the_clip_as_a_video_url(reqs):
    body = chat_body(reqs[0])
    parts = body["messages"][0]["content"]
    assert [p["type"] for p in parts] == ["video_url", "text"]
    assert parts[0]["video_url"]["url"].startswith("data:video/mp4;base64,")
    assert parts[1]["text"] == user_text(reqs[0].prompt) and VIDEO_PLACEHOLDER not in parts[1]["text"]


def test_other_presets_have_no_videos():
    assert all(not r.videos for r in build_workload(PRESETS["mixed"].with_(num_requests=4)))
