"""The OpenAI-compatible HTTP front, driven by the official `openai` client and raw HTTP, in
front of a real scheduler and a real engine instance. Greedy output through HTTP equals the
gRPC API's and transformers' `generate`."""
import json

import openai
import pytest

from epdserve import Client
from epdserve.model.chat import chat_to_prompt
from epdserve.model.reference import ReferenceGenerator
from tests.entrypoints.http_harness import RunningFront, connect, data_url, metered_scheduler, post
from tests.scheduler.engine_instance import EngineInstance
from tests.scheduler.harness import image, start_scheduler, wait_until

KEY = "sk-test-epdserve"


@pytest.fixture(scope="module")
def instance(qwen2_vl_tiny):
    inst = EngineInstance(qwen2_vl_tiny, "epd0").start()
    yield inst
    inst.stop()


@pytest.fixture(scope="module")
def metered(qwen2_vl_tiny, instance):
    s, metrics = metered_scheduler(qwen2_vl_tiny, [instance])
    yield s, metrics
    s.stop()


@pytest.fixture(scope="module")
def sched(metered):
    return metered[0]


@pytest.fixture(scope="module")
def front(metered):
    sched, metrics = metered
    f = RunningFront(sched, metrics, api_key=KEY, served_model_name="tiny-vl", max_body_bytes=4 << 20)
    yield f
    f.stop()


@pytest.fixture(scope="module")
def oai(front):
    with openai.OpenAI(base_url=front.base_url, api_key=KEY, max_retries=0, timeout=120) as c:
        yield c


def _messages(img: bytes, text: str) -> list[dict]:
    return [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": data_url(img)}},
                                         {"type": "text", "text": text}]}]


GREEDY = dict(temperature=0, max_tokens=8, extra_body={"ignore_eos": True, "return_token_ids": True})


def test_chat_with_image_matches_grpc_and_transformers(qwen2_vl_tiny, sched, oai):
    img = image(3)
    r = oai.chat.completions.create(model="tiny-vl", messages=_messages(img, "What is this?"), **GREEDY)
    ids = r.choices[0].model_extra["token_ids"]
    assert len(ids) == 8 and r.choices[0].finish_reason == "length"
    grpc_messages = [{"role": "user", "content": [{"type": "image", "image": img},
                                                  {"type": "text", "text": "What is this?"}]}]
    with Client(sched.address, timeout=60) as c:
        g = c.chat(grpc_messages, max_tokens=8, ignore_eos=True)
    ref = ReferenceGenerator(qwen2_vl_tiny)
    from transformers import AutoTokenizer

    prompt = chat_to_prompt(AutoTokenizer.from_pretrained(qwen2_vl_tiny), grpc_messages, True)
    assert ids == g.token_ids == ref.generate(prompt["prompt"], [img], max_tokens=8, ignore_eos=True)
    assert r.choices[0].message.content == g.text and r.choices[0].message.role == "assistant"
    assert r.usage.completion_tokens == 8 and r.usage.prompt_tokens == g.usage.prompt_tokens
    assert r.usage.total_tokens == r.usage.prompt_tokens + 8 and r.model == "tiny-vl"


def test_usage_counts_prompt_tokens_served_from_the_prefix_cache(oai):
    msgs = _messages(image(7), "Again?")
    first = oai.chat.completions.create(model="tiny-vl", messages=msgs, **GREEDY)
    second = oai.chat.completions.create(model="tiny-vl", messages=msgs, **GREEDY)
    assert first.usage.prompt_tokens_details.cached_tokens == 0
    assert 0 < second.usage.prompt_tokens_details.cached_tokens < second.usage.prompt_tokens  # the KV of the first
    assert second.choices[0].model_extra["token_ids"] == first.choices[0].model_extra["token_ids"]


def test_streamed_chat_equals_unstreamed_and_reports_usage(oai):
    msgs = _messages(image(4), "Stream it")
    whole = oai.chat.completions.create(model="tiny-vl", messages=msgs, **GREEDY)
    chunks = list(oai.chat.completions.create(model="tiny-vl", messages=msgs, stream=True,
                                              stream_options={"include_usage": True}, **GREEDY))
    assert chunks[0].choices[0].delta.role == "assistant"
    ids = [t for ch in chunks if ch.choices for t in ch.choices[0].model_extra.get("token_ids", [])]
    text = "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices)
    assert ids == whole.choices[0].model_extra["token_ids"] and text == whole.choices[0].message.content
    finals = [ch for ch in chunks if ch.choices and ch.choices[0].finish_reason]
    assert [f.choices[0].finish_reason for f in finals] == ["length"]
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 8
    assert all(ch.usage is None for ch in chunks[:-1])


def test_completions_match_grpc_and_models_lists_the_model(sched, oai):
    r = oai.completions.create(model="tiny-vl", prompt="Once upon a time", **GREEDY)
    with Client(sched.address, timeout=60) as c:
        g = c.generate("Once upon a time", max_tokens=8, ignore_eos=True)
    assert r.choices[0].model_extra["token_ids"] == g.token_ids and r.choices[0].text == g.text
    streamed = list(oai.completions.create(model="tiny-vl", prompt="Once upon a time", stream=True, **GREEDY))
    assert "".join(c.choices[0].text for c in streamed) == g.text
    assert [m.id for m in oai.models.list().data] == ["tiny-vl"]


def test_sse_framing_on_the_wire(front):
    conn = connect(front)
    body = {"model": "tiny-vl", "prompt": "Hello", "max_tokens": 5, "temperature": 0, "ignore_eos": True,
            "stream": True, "stream_options": {"include_usage": True}}
    conn.request("POST", "/v1/completions", body=json.dumps(body),
                 headers={"Authorization": f"Bearer {KEY}", "Content-Type": "application/json"})
    resp = conn.getresponse()
    assert resp.status == 200 and resp.getheader("content-type").startswith("text/event-stream")
    raw = resp.read().decode()
    conn.close()
    assert raw.endswith("\n\n")
    events = raw[:-2].split("\n\n")
    assert all(e.startswith("data: ") and "\n" not in e for e in events)
    assert events[-1] == "data: [DONE]"
    payloads = [json.loads(e[len("data: "):]) for e in events[:-1]]
    assert all(p["object"] == "text_completion" for p in payloads)
    assert payloads[-1]["usage"]["completion_tokens"] == 5 and payloads[-1]["choices"] == []
    assert sum(1 for p in payloads if p["choices"] and p["choices"][0]["finish_reason"] == "length") == 1


def test_wrong_or_missing_key_is_401(front, caplog):
    with openai.OpenAI(base_url=front.base_url, api_key="sk-wrong", max_retries=0) as bad:
        with pytest.raises(openai.AuthenticationError):
            bad.models.list()
        with pytest.raises(openai.AuthenticationError):
            bad.chat.completions.create(model="tiny-vl", messages=[{"role": "user", "content": "hi"}])
    status, body = post(front, "/v1/completions", {"prompt": "hi"})
    assert status == 401 and body["error"]["code"] == 401
    assert KEY not in caplog.text and "sk-wrong" not in caplog.text


def test_bad_input_is_400_and_big_body_413(front, oai):
    bad = [dict(messages=[{"role": "user", "content": "hi"}], top_p=2.0),
           dict(messages=_messages(b"not an image", "x")),
           dict(messages=[{"role": "user", "content": [{"type": "image_url",
                                                        "image_url": {"url": "http://127.0.0.1:9/x.png"}}]}]),
           dict(messages=[{"role": "user", "content": "hi"}], top_logprobs=2),  # without logprobs
           dict(messages=[])]
    for kw in bad:
        with pytest.raises(openai.BadRequestError):
            oai.chat.completions.create(model="tiny-vl", **kw)
    with pytest.raises(openai.BadRequestError, match="images"):  # epdserve.limits: 16 images at most
        oai.chat.completions.create(model="tiny-vl", messages=[{"role": "user", "content": [
            {"type": "image_url", "image_url": {"url": data_url(image(1))}}] * 17}])
    with pytest.raises(openai.NotFoundError):
        oai.completions.create(model="other-model", prompt="hi")
    status, body = post(front, "/v1/completions", None, key=KEY, raw=b"{" + b" " * (5 << 20) + b"}")
    assert status == 413 and "larger" in body["error"]["message"]
    status, body = post(front, "/v1/completions", None, key=KEY, raw=b"{not json")
    assert status == 400 and body["error"]["type"] == "BadRequestError"
    # the server carries on
    assert oai.completions.create(model="tiny-vl", prompt="still here", max_tokens=2).usage.completion_tokens == 2


def test_client_disconnect_aborts_the_request(front, sched, instance):
    conn = connect(front)
    body = {"prompt": "Count forever", "max_tokens": 400, "ignore_eos": True, "stream": True}
    conn.request("POST", "/v1/completions", body=json.dumps(body),
                 headers={"Authorization": f"Bearer {KEY}", "Content-Type": "application/json"})
    resp = conn.getresponse()
    assert resp.status == 200 and resp.read(6) == b"data: "
    conn.sock.close()
    conn.close()
    wait_until(lambda: any(a.startswith("cmpl-") for a in instance.aborted), what="the abort to reach the instance")
    wait_until(lambda: not sched.call(lambda: dict(sched.server.dispatcher.runs)), what="the request to end")


def test_queue_full_is_429_and_no_instance_503(qwen2_vl_tiny, instance):
    busy = start_scheduler(qwen2_vl_tiny, [instance], max_requests_in_flight=1)
    empty = start_scheduler(qwen2_vl_tiny, [])
    fronts = [RunningFront(busy), RunningFront(empty)]
    try:
        with openai.OpenAI(base_url=fronts[0].base_url, api_key="none", max_retries=0, timeout=60) as c:
            stream = c.completions.create(model=str(qwen2_vl_tiny), prompt="busy", max_tokens=400, stream=True,
                                          extra_body={"ignore_eos": True})
            next(iter(stream))
            with pytest.raises(openai.RateLimitError):
                c.completions.create(model=str(qwen2_vl_tiny), prompt="second", max_tokens=2)
            stream.close()
        with openai.OpenAI(base_url=fronts[1].base_url, api_key="none", max_retries=0, timeout=60) as c:
            with pytest.raises(openai.InternalServerError) as e:
                c.completions.create(model=str(qwen2_vl_tiny), prompt="nobody", max_tokens=2)
            assert e.value.status_code == 503
    finally:
        for f in fronts:
            f.stop()
        busy.stop()
        empty.stop()


def test_request_past_its_deadline_is_504(sched, instance):
    front = RunningFront(sched, request_timeout_s=0.3)  # --http-request-timeout
    try:
        with openai.OpenAI(base_url=front.base_url, api_key="none", max_retries=0, timeout=60) as c:
            with pytest.raises(openai.InternalServerError) as e:  # hundreds of tokens: far past 0.3 s
                c.completions.create(model=str(sched.config.model), prompt="long", max_tokens=100000,
                                     extra_body={"ignore_eos": True})
            assert e.value.status_code == 504
    finally:
        front.stop()
    wait_until(lambda: not sched.call(lambda: dict(sched.server.dispatcher.runs)), what="the request to end")
