"""One prefix hash: the router's hashes of a prompt (the scheduler's own preprocessing of a chat
with an image, a video, or text only) are the digests of the blocks the engines cache for it —
a prefilling engine given the request's media as the instance gives them (`convert.media_items`),
and a decode-only engine given their identity (`media_identity`) — at CPU's block size 16 and
NPU's 128 (no step runs: the engine's own hasher, on the tiny Qwen2-VL)."""
from pathlib import Path

import pytest

from epdserve.engine.config import EngineConfig
from epdserve.engine.llm_engine import LLMEngine
from epdserve.engine.sampling_params import SamplingParams
from epdserve.engine.request_parts import PrefixMemo
from epdserve.engine.sequence import Sequence
from epdserve.instance.convert import media_items
from epdserve.instance.decode_worker import media_identity
from epdserve.rpc import common_pb2, instance_pb2, serve_pb2
from epdserve.scheduler.preprocess import RequestPreprocessor
from epdserve.scheduler.prompt_chunks import PromptChunker
from tests.scheduler.harness import image

VIDEO = (Path(__file__).resolve().parents[1] / "model" / "fixtures" / "video" / "mp4_h264.mp4").read_bytes()
SYSTEM = "You are a careful assistant who describes pictures in detail and answers follow-up questions. " * 12


@pytest.fixture(scope="module")
def pre(qwen2_vl_tiny):
    return RequestPreprocessor(str(qwen2_vl_tiny))


@pytest.fixture(scope="module", params=[16, 128])
def engine(request, qwen2_vl_tiny):
    eng = LLMEngine(EngineConfig(model=str(qwen2_vl_tiny), device="cpu", block_size=request.param,
                                 kv_cache_bytes=8 << 20))
    assert eng.config.block_size == request.param
    return eng


def chat(part: serve_pb2.ContentPart | None) -> serve_pb2.GenerateRequest:
    parts = [serve_pb2.ContentPart(text="What happens here, in detail?")] + ([part] if part is not None else [])
    return serve_pb2.GenerateRequest(chat=serve_pb2.Chat(messages=[
        serve_pb2.ChatMessage(role="system", content=[serve_pb2.ContentPart(text=SYSTEM)]),
        serve_pb2.ChatMessage(role="user", content=parts)]))


PARTS = {
    "image": serve_pb2.ContentPart(image=common_pb2.Media(data=image(0))),
    "video": serve_pb2.ContentPart(video=common_pb2.Media(data=VIDEO, video=common_pb2.VideoSpec(fps=2.0))),
    "text": None,
}


@pytest.mark.parametrize("kind", list(PARTS))
def test_router_hashes_equal_the_engines_block_keys(pre, engine, kind):
    prep = pre.prepare(chat(PARTS[kind]), engine.model.namespace)
    bs = engine.config.block_size
    ids = prep.prompt_token_ids
    assert len(ids) >= 2 * bs and (kind == "text") == (not prep.media)
    refs = [instance_pb2.MediaRef(key=m.key, data=m.data, grid_thw=m.grid_thw, num_tokens=m.num_tokens, video=m.video)
            for m in prep.media]
    chunker = PromptChunker((pre.image_token_id, pre.processor.video_token_id))
    router = chunker.hashes(ids, prep.media, bs)
    assert len(router) == len(ids) // bs
    hasher = engine.scheduler.hasher
    prefill = Sequence("p", list(ids), SamplingParams(), media=media_items(engine, refs))
    decode = Sequence("d", list(ids), SamplingParams(), prefix=PrefixMemo(media_identity=media_identity(refs)))
    assert [k.digest for k in hasher.hashes(prefill, len(ids))] == router
    assert [k.digest for k in hasher.hashes(decode, len(ids))] == router
    assert chunker.by_block_size(ids, prep.media, [bs, bs]) == {bs: router}


def test_another_block_size_another_hash(pre):
    prep = pre.prepare(chat(PARTS["image"]), "ns")
    chunker = PromptChunker((pre.image_token_id, pre.processor.video_token_id))
    h = chunker.by_block_size(prep.prompt_token_ids, prep.media, [16, 128])
    assert len(h[16]) == len(prep.prompt_token_ids) // 16 and len(h[128]) == len(prep.prompt_token_ids) // 128
    assert not set(h[16]) & set(h[128])
