"""Video in chat over gRPC and HTTP (Qwen3-VL tiny, a real EPD instance behind a real scheduler and
its HTTP front): a `video` content part over gRPC, and an OpenAI `video_url` data: URL through the
`openai` client, give the offline `LLM.chat`'s greedy tokens (themselves checked against
transformers' golden video tokens in tests/engine/test_video.py). The instance encodes the video a
temporal patch per step (--encode-token-budget below one patch's tokens)."""
from __future__ import annotations

import base64
from pathlib import Path
from types import SimpleNamespace

import grpc
import openai
import pytest

from epdserve import LLM, Client, SamplingParams
from epdserve.client import EPDServeError
from epdserve.instance.config import InstanceConfig
from epdserve.instance.host import InstanceHost
from epdserve.model.demo_images import jpeg_bytes, procedural_image
from tests.entrypoints.http_harness import RunningFront, post
from tests.scheduler.harness import start_scheduler

VIDEO = (Path(__file__).parents[1] / "model" / "fixtures" / "video" / "mp4_h264.mp4").read_bytes()
IMAGE = jpeg_bytes(procedural_image(70, 50, 5))
MAX_TOKENS = 8


def _url(mime: str, data: bytes) -> str:
    return f"data:{mime};base64," + base64.b64encode(data).decode()


MESSAGES = [{"role": "user", "content": [
    {"type": "video_url", "video_url": {"url": _url("video/mp4", VIDEO)}},
    {"type": "text", "text": "What happens, and what is in"},
    {"type": "image_url", "image_url": {"url": _url("image/jpeg", IMAGE)}},
    {"type": "text", "text": "?"}]}]


@pytest.fixture(scope="module")
def served(qwen3_vl_tiny):
    host = InstanceHost(InstanceConfig(roles="EPD", model=str(qwen3_vl_tiny), kv_cache_bytes=4 << 20,
                                       encode_token_budget=4)).start()
    sched = start_scheduler(qwen3_vl_tiny, [SimpleNamespace(address=f"127.0.0.1:{host.port}",
                                                            instance_id=host.instance_id)])
    front = RunningFront(sched, served_model_name="tiny-vl")
    yield sched, front, host
    front.stop()
    sched.stop()
    host.stop()


@pytest.fixture(scope="module")
def offline(qwen3_vl_tiny):
    out = LLM(model=qwen3_vl_tiny, device="cpu").chat(MESSAGES, SamplingParams(max_tokens=MAX_TOKENS, ignore_eos=True))
    assert out[0].error is None and out[0].num_vision_tokens == 2 * 6 + 4  # 2 temporal patches of 6 + the image's 4
    return out[0].outputs[0].token_ids


def test_grpc_chat_with_a_video_equals_offline(served, offline):
    sched, _, host = served
    as_bytes = [{"role": "user", "content": [{"type": "video", "video": VIDEO}, *MESSAGES[0]["content"][1:]]}]
    with Client(sched.address, timeout=120) as c:
        url = c.chat(MESSAGES, max_tokens=MAX_TOKENS, ignore_eos=True)
        raw = c.chat(as_bytes, max_tokens=MAX_TOKENS, ignore_eos=True)
        with pytest.raises(EPDServeError) as bad:
            c.chat([{"role": "user", "content": [{"type": "video", "video": b"not a video"}]}], max_tokens=2)
        over = [{"role": "user",
                 "content": [{"type": "video", "video": VIDEO, "video_options": {"max_frames": 10**6}}]}]
        with pytest.raises(EPDServeError) as too_many:  # the part's sampling options reach the scheduler
            c.chat(over, max_tokens=2)
        assert c.chat(MESSAGES, max_tokens=MAX_TOKENS, ignore_eos=True).token_ids == offline  # still serving
    assert url.token_ids == raw.token_ids == offline
    encoders = [w.engine.encoder for w in host.workers if w.engine.config.encodes]
    assert encoders and all(e.token_budget == 4 for e in encoders)
    assert sum(e.encoder_calls for e in encoders) > sum(e.encoder_runs for e in encoders)  # videos in slices
    assert bad.value.code == grpc.StatusCode.INVALID_ARGUMENT and "video" in str(bad.value)
    assert too_many.value.code == grpc.StatusCode.INVALID_ARGUMENT and "max_frames" in str(too_many.value)


def test_http_chat_with_a_video_url_equals_grpc(served, offline):
    _, front, _ = served
    with openai.OpenAI(base_url=front.base_url, api_key="none", max_retries=0, timeout=120) as oai:
        r = oai.chat.completions.create(model="tiny-vl", messages=MESSAGES, temperature=0, max_tokens=MAX_TOKENS,
                                        extra_body={"ignore_eos": True, "return_token_ids": True})
    assert r.choices[0].model_extra["token_ids"] == offline
    remote = [{"role": "user", "content": [{"type": "video_url", "video_url": {"url": "https://x/v.mp4"}}]}]
    status, body = post(front, "/v1/chat/completions", {"model": "tiny-vl", "messages": remote})
    assert status == 400 and "data: URL" in body["error"]["message"]
    corrupt = [{"role": "user", "content": [{"type": "video_url", "video_url": {"url": _url("video/mp4", b"junk")}}]}]
    status, body = post(front, "/v1/chat/completions", {"model": "tiny-vl", "messages": corrupt})
    assert status == 400 and "video" in body["error"]["message"]
