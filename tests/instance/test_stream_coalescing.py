"""Stream coalescing on an instance: with a stream interval, a request's tokens after the first
travel in fewer messages, the first message goes at once (never held for the interval; it
carries whatever the engine had already queued, so under load it may hold more than one token),
and the tokens are unchanged (greedy, against transformers' generate)."""
from __future__ import annotations

from types import SimpleNamespace

import pytest

from epdserve.engine.outputs import RequestOutput
from epdserve.instance.config import InstanceConfig
from epdserve.instance.convert import coalesce
from epdserve.instance.host import InstanceHost
from epdserve.instance.servicer import InstanceServicer
from epdserve.instance.worker import RequestHandle
from epdserve.model.reference import ReferenceGenerator
from epdserve.rpc import common_pb2, instance_pb2
from tests.instance.harness import PH, Prepared, image, stub


def test_coalesce_joins_new_tokens_and_keeps_the_last_state():
    a = RequestOutput("r", [5], "a", [5], "a", False, timings={"first_token": 1.0})
    b = RequestOutput("r", [6, 7], "bc", [5, 6, 7], "abc", True, finish_reason="length")
    c = coalesce([a, b])
    assert (c.new_token_ids, c.new_text, c.finished, c.finish_reason) == ([5, 6, 7], "abc", True, "length")
    assert coalesce([a]) is a


@pytest.fixture(scope="module")
def pd_host(qwen2_vl_tiny):
    host = InstanceHost(InstanceConfig(roles="EPD", model=str(qwen2_vl_tiny), kv_cache_bytes=4 << 20,
                                       stream_interval_ms=400)).start()
    yield host
    host.stop()


def test_tokens_after_the_first_travel_together(pd_host, qwen2_vl_tiny):
    ref = ReferenceGenerator(qwen2_vl_tiny)
    prompt, images = f"Describe {PH} briefly", [image(31)]
    req = Prepared(ref.processor, pd_host.status().media_namespace, prompt, images, expect_features=False)
    deltas = list(stub(f"127.0.0.1:{pd_host.port}").Generate(instance_pb2.InstanceGenerateRequest(
        request_id="c-1", prompt_token_ids=req.token_ids, media=req.refs,
        sampling=common_pb2.SamplingParams(max_tokens=12, ignore_eos=True)), timeout=120))
    tokens = [t for d in deltas for t in d.token_ids]
    assert tokens == ref.generate(prompt, images, max_tokens=12)
    assert len(deltas) < len(tokens) and deltas[-1].finished


def _out(tokens: list[int], finished: bool = False) -> RequestOutput:
    return RequestOutput("r", tokens, "", tokens, "", finished)


def test_the_first_message_is_never_held_and_joins_what_is_queued():
    """Before a request has streamed anything its next message waits for nothing: with an hour's
    stream interval, one queued output goes out alone at once (held, this test would hang); two
    queued outputs go out joined."""
    servicer = InstanceServicer(SimpleNamespace(config=SimpleNamespace(stream_interval_ms=3_600_000)))
    handle = RequestHandle("r")
    handle.put(_out([5]))
    (first,) = servicer._next_deltas(handle, None, streamed=False, unfinished=1)
    assert first.new_token_ids == [5]
    handle.put(_out([6]))
    handle.put(_out([7], finished=True))
    (joined,) = servicer._next_deltas(handle, None, streamed=False, unfinished=1)
    assert joined.new_token_ids == [6, 7] and joined.finished
