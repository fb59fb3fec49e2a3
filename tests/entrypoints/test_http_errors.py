"""What a client reads when its request fails, from the client's side of the real HTTP front (the
official `openai` client and raw HTTP) and the gRPC API, in front of a real scheduler and engine
instance: errors name the input ("image 2 (image/jpeg data URL, ...) is not a readable image"),
never a Python object's repr; unsupported content parts and malformed bodies are one-sentence
400s in OpenAI's error shape; a 500 is JSON without a traceback; and every one of them is
counted in `epdserve:requests_total` by status, while the other requests carry on."""
from __future__ import annotations

import asyncio
import urllib.request

import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from epdserve import Client
from epdserve.client import EPDServeError
from epdserve.entrypoints.http import HttpFront, HttpOptions
from tests.entrypoints.http_harness import data_url, post, served_front
from tests.scheduler.harness import PH, image

FAIL_STREAM = "fail while generating"
FAIL_HANDOFF = "fail handing over"


@pytest.fixture(scope="module")
def served(qwen2_vl_tiny):
    yield from served_front(qwen2_vl_tiny, "epd-e", served_model_name="tiny-vl")


def counted(front):
    """{status: epdserve:requests_total} at the front's /metrics (prometheus_client's own parser)."""
    text = urllib.request.urlopen(front.url + "/metrics", timeout=30).read().decode()
    return {s.labels["status"]: s.value for fam in text_string_to_metric_families(text) for s in fam.samples
            if s.name == "epdserve:requests_total"}


def grew(before: dict, after: dict) -> dict:
    return {k: after[k] - before.get(k, 0.0) for k in after if after[k] != before.get(k, 0.0)}


def _chat(*parts):
    return [{"role": "user", "content": list(parts)}]


def test_a_corrupt_image_is_named_not_a_repr_and_the_others_carry_on(served):
    sched, front = served
    before = counted(front)
    good = {"type": "image_url", "image_url": {"url": data_url(image(3))}}
    corrupt = {"type": "image_url", "image_url": {"url": data_url(b"not an image at all")}}
    with openai.OpenAI(base_url=front.base_url, api_key="none", max_retries=0, timeout=60) as oai:
        with pytest.raises(openai.BadRequestError) as e:
            oai.chat.completions.create(model="tiny-vl", max_tokens=3, messages=_chat(
                good, {"type": "text", "text": "and"}, corrupt))
        ok = oai.chat.completions.create(model="tiny-vl", max_tokens=3, extra_body={"ignore_eos": True},
                                         messages=_chat(good, {"type": "text", "text": "what?"}))
    err = e.value.body
    assert err["message"].startswith("image 2 (image/jpeg data URL, messages[0].content[2]) is not a readable "
                                     "image (19 bytes): not in an image format"), err
    assert err["param"] == "messages[0].content[2].image_url" and err["type"] == "BadRequestError"
    assert ok.choices[0].finish_reason == "length"
    with Client(sched.address, timeout=60) as c:  # the gRPC API: bytes past the header check, then refused
        with pytest.raises(EPDServeError) as g:
            c.generate(f"{PH} and {PH}", images=[image(1), image(2)[:300]], max_tokens=3)
    assert g.value.details.startswith("image 2 is not a readable image (300 bytes"), g.value.details
    for text in (err["message"], g.value.details):
        assert "object at 0x" not in text and "<_io" not in text
    assert grew(before, counted(front)) == {"INVALID_ARGUMENT": 2, "ok": 1}


@pytest.mark.parametrize("part, message", [
    ({"type": "input_audio", "input_audio": {"data": "UklGRg==", "format": "wav"}}, "audio input is not supported"),
    ({"type": "file", "file": {"file_data": "data:application/pdf;base64,JVBERi0=", "filename": "a.pdf"}},
     "file input is supported only as an uploaded image's file.file_id (POST /v1/files)"),
    ({"type": "hologram", "hologram": {}},
     "content part type 'hologram' is not supported; supported: text, image_url, video_url, file"),
])
def test_unsupported_content_parts_are_400_by_name(served, part, message):
    _, front = served
    before = counted(front)
    with openai.OpenAI(base_url=front.base_url, api_key="none", max_retries=0, timeout=60) as oai:
        with pytest.raises(openai.BadRequestError) as e:
            oai.chat.completions.create(model="tiny-vl", messages=_chat({"type": "text", "text": "hear"}, part))
    assert e.value.status_code == 400
    assert e.value.body == {"message": f"messages[0].content[1]: {message}", "type": "BadRequestError",
                            "param": "messages[0].content[1].type", "code": 400}
    assert grew(before, counted(front)) == {"INVALID_ARGUMENT": 1}


CHAT, COMPLETIONS = "/v1/chat/completions", "/v1/completions"


@pytest.mark.parametrize("path, body, message", [
    (CHAT, {"messages": [{"role": "user", "content": [{"text": "no type"}]}]}, "messages[0].content[0].type is required"),
    (CHAT, {"messages": [{"role": "user", "content": 5}]},
     "messages[0].content must be a string or a list of content parts"),
    (CHAT, {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 10**30},
     "max_tokens: Input should be less than or equal to 2147483647"),  # was an uncounted plain-text 500
    (CHAT, {"messages": [{"role": "user", "content": "hi"}], "seed": 2**70},
     "seed: Input should be less than or equal to 9223372036854775807"),
    (COMPLETIONS, {"prompt": [1, "a"]},
     "prompt must be a string, a list of token ids, a list of strings or a list of token-id lists"),
    (COMPLETIONS, {"prompt": [2**40]}, "prompt[0]: Input should be less than or equal to 2147483647"),
    (COMPLETIONS, b'{"prompt": "hi",', "the request body is not valid JSON: "),
    (COMPLETIONS, [1, 2], "the request body must be a JSON object"),
])
def test_malformed_bodies_are_one_readable_sentence(served, path, body, message):
    _, front = served
    before = counted(front)
    raw = body if isinstance(body, bytes) else None
    status, answer = post(front, path, None if raw else body, raw=raw)
    assert status == 400 and answer["error"]["message"].startswith(message), answer
    assert ".str" not in answer["error"]["message"] and answer["error"]["type"] == "BadRequestError"
    assert grew(before, counted(front)) == {"INVALID_ARGUMENT": 1}


class FailingScheduler:
    """The HTTP front's one dependency, the started `SchedulerServer`, unchanged except for two
    prompts: FAIL_STREAM gets a delta stream that raises (through the server's own metrics
    observer, where a bug in the dispatcher would raise), FAIL_HANDOFF fails as it is handed
    over. Injected here, at the boundary, because no real input reaches an unexpected exception
    any more (the out-of-range integers that did are 400s now)."""

    def __init__(self, server):
        self._server = server

    def __getattr__(self, name):
        return getattr(self._server, name)

    def generate(self, req, deadline=None, tenant=""):
        if req.prompt == FAIL_HANDOFF:
            raise KeyError("<epdserve.scheduler.Run object at 0xdeadbeef>")
        if req.prompt != FAIL_STREAM:
            return self._server.generate(req, deadline, tenant)

        async def broken():
            raise RuntimeError("<epdserve.scheduler.Run object at 0xdeadbeef> went wrong")
            yield  # an async generator, as the dispatcher's stream is

        return self._server.observer.observe(broken(), self._server)


@pytest.fixture(scope="module")
def failing(served):
    sched, _ = served
    front = HttpFront(FailingScheduler(sched.server), HttpOptions(served_model_name="tiny-vl"), sched.server.observer)
    asyncio.run_coroutine_threadsafe(front.start(), sched.loop).result(30)
    yield front
    asyncio.run_coroutine_threadsafe(front.stop(), sched.loop).result(30)


def test_an_internal_failure_is_a_counted_json_500_without_a_traceback(served, failing):
    _, front = served
    before = counted(front)
    with openai.OpenAI(base_url=failing.url + "/v1", api_key="none", max_retries=0, timeout=60) as oai:
        for prompt, stream in ((FAIL_STREAM, False), (FAIL_STREAM, True), (FAIL_HANDOFF, False)):
            with pytest.raises(openai.InternalServerError) as e:  # before the first token: a status, streamed or not
                oai.completions.create(model="tiny-vl", prompt=prompt, max_tokens=3, stream=stream)
            assert e.value.status_code == 500 and e.value.body["type"] == "InternalServerError"
            message = e.value.body["message"]
            assert message.startswith("internal error in the server while ") and "log has the details" in message
            assert "0x" not in message and "Traceback" not in e.value.response.text
        fine = oai.completions.create(model="tiny-vl", prompt="still fine", max_tokens=3, extra_body={"ignore_eos": True})
    assert fine.choices[0].finish_reason == "length"
    assert grew(before, counted(front)) == {"INTERNAL": 3, "ok": 1}
