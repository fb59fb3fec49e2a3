"""Client API: request building (every SamplingParams field, images, chat parts) and the asyncio
twin against a real scheduler in front of a real EPD engine instance."""
import asyncio
import base64
import io

import grpc
import pytest
from PIL import Image

from epdserve import AsyncClient, Client
from epdserve.client import EPDServeError, MediaKey, Timing, build_request
from tests.scheduler.engine_instance import EngineInstance
from tests.scheduler.harness import PH, image, start_scheduler


def test_build_request_every_sampling_field_and_media_kinds(tmp_path):
    path = tmp_path / "img.jpg"
    path.write_bytes(image(1))
    pil = Image.new("RGB", (20, 20), "red")
    req = build_request(f"{PH}{PH}{PH}{PH}", images=[image(0), pil, path, MediaKey("ns@1:abc")], max_tokens=7,
                        temperature=0.5, top_p=0.9, top_k=5, seed=3, stop="END", stop_token_ids=[1, 2],
                        ignore_eos=True, skip_special_tokens=False, request_id="r1")
    s = req.sampling
    assert (s.max_tokens, s.temperature, s.top_p, s.top_k, s.seed, list(s.stop), list(s.stop_token_ids),
            s.ignore_eos, s.skip_special_tokens) == (7, 0.5, 0.9, 5, 3, ["END"], [1, 2], True, False)
    assert req.request_id == "r1" and req.WhichOneof("input") == "prompt"
    assert req.media[0].data == image(0) and Image.open(io.BytesIO(req.media[1].data)).size == (20, 20)
    assert req.media[2].data == image(1) and req.media[3].key == "ns@1:abc"
    unset = build_request([1, 2, 3]).sampling
    assert list(build_request([1, 2, 3]).prompt_token_ids.ids) == [1, 2, 3] and not unset.HasField("top_p")


def test_build_chat_request_parts():
    url = "data:image/jpeg;base64," + base64.b64encode(image(2)).decode()
    req = build_request(chat=[
        {"role": "system", "content": "be brief"},
        {"role": "user", "content": [{"type": "image_url", "image_url": {"url": url}}, {"type": "text", "text": "hi"},
                                     {"type": "image", "key": "ns@1:k"}]},
    ], add_generation_prompt=False)
    msgs = req.chat.messages
    assert [m.role for m in msgs] == ["system", "user"] and msgs[0].content[0].text == "be brief"
    assert msgs[1].content[0].image.data == image(2) and msgs[1].content[2].image.key == "ns@1:k"
    assert req.chat.add_generation_prompt is False
    with pytest.raises(ValueError):
        build_request(chat=[{"role": "user", "content": [{"type": "image_url", "image_url": "http://x/y.png"}]}])
    with pytest.raises(ValueError):
        build_request()
    with pytest.raises(TypeError):
        build_request("x", images=[3.14])


def test_timing_durations():
    t = Timing(arrival=1.0, dispatched=1.5, encode_start=2.0, encode_end=3.0, prefill_start=3.5, first_token=4.0,
               kv_transfer_end=4.25, first_decode=4.5, finished=6.0)
    assert (t.queue_s, t.encode_s, t.e2p_s, t.prefill_s, t.p2d_s, t.first_decode_s, t.ttft_s, t.total_s) == (
        0.5, 1.0, 0.5, 0.5, 0.25, 0.25, 3.0, 5.0)
    assert Timing(arrival=1.0).encode_s is None


@pytest.fixture(scope="module")
def served(qwen2_vl_tiny):
    inst = EngineInstance(qwen2_vl_tiny, "client-epd").start()
    sched = start_scheduler(qwen2_vl_tiny, [inst])
    yield sched.address
    sched.stop()
    inst.stop()


def test_async_client_generate_stream_chat_and_errors(served):
    prompt = f"Async {PH} test"

    async def main():
        async with AsyncClient(served, timeout=60) as c:
            assert await c.health() == "SERVING"
            info = await c.model_info()
            whole = await c.generate(prompt, images=[image(3)], max_tokens=6)
            deltas = [d async for d in c.generate_stream(prompt, images=[image(3)], max_tokens=6)]
            chat = await c.chat([{"role": "user", "content": "hello"}], max_tokens=3)
            with pytest.raises(EPDServeError) as e:
                await c.generate(f"bad {PH}", images=[b"\xff\xd8 not a jpeg"])
            return info, whole, deltas, chat, e.value

    info, whole, deltas, chat, err = asyncio.run(main())
    assert info.image_placeholder == PH and info.media_namespace
    assert [t for d in deltas for t in d.token_ids] == whole.token_ids
    assert "".join(d.text for d in deltas) == whole.text
    assert deltas[-1].finished and all(not d.finished for d in deltas[:-1])
    u1, u2 = whole.usage, deltas[-1].usage
    assert (u2.prompt_tokens, u2.vision_tokens, u2.output_tokens) == (u1.prompt_tokens, u1.vision_tokens, u1.output_tokens)
    assert u1.cached_vision_tokens == 0 and u2.cached_vision_tokens == u2.vision_tokens  # the same image again
    assert chat.usage.output_tokens == len(chat.token_ids) <= 3
    assert err.code == grpc.StatusCode.INVALID_ARGUMENT


def test_sync_client_stream_equals_unary_and_sampling_is_seeded(served):
    with Client(served, timeout=60) as c:
        c.wait_ready(10)
        whole = c.generate("Seeded", max_tokens=8, temperature=1.0, top_k=50, seed=7)
        again = c.generate("Seeded", max_tokens=8, temperature=1.0, top_k=50, seed=7)
        streamed = [t for d in c.generate_stream("Seeded", max_tokens=8, temperature=1.0, top_k=50, seed=7)
                    for t in d.token_ids]
    assert whole.token_ids == again.token_ids == streamed


def test_deadline_exceeded(served):
    with Client(served) as c:
        with pytest.raises(EPDServeError) as e:
            c.generate("slow", max_tokens=4000, ignore_eos=True, timeout=0.3)
    assert e.value.code == grpc.StatusCode.DEADLINE_EXCEEDED


def test_unreachable_server_is_unavailable():
    from epdserve.rpc.servers import free_port

    with Client(f"127.0.0.1:{free_port()}", timeout=5) as c:
        with pytest.raises(EPDServeError) as e:
            c.generate("anyone?")
    assert e.value.code == grpc.StatusCode.UNAVAILABLE
