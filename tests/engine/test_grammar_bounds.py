"""Structured outputs cannot grow an engine without bound or stall it for everyone (issue 51 item
3), on the tiny demo model with real xgrammar compiles: a compiled grammar over `max_grammar_bytes`
fails its request alone with an error naming the limit and is never cached, while a neighbour
decodes on; the compiled-grammar cache is bounded in bytes (xgrammar's own measure), least
recently used evicted first; a schema over `max_structured_output_bytes` is refused before anything
parses it, at the scheduler's limits (any front) and at the HTTP front's conversion."""
import json

import pytest

from epdserve import LLM, SamplingParams
from epdserve.engine.structured_output import StructuredOutput
from epdserve.entrypoints.http.convert import sampling
from epdserve.entrypoints.http.errors import ApiError
from epdserve.entrypoints.http.protocol import ChatCompletionRequest
from epdserve.limits import InputLimits, LimitError, check_generate_request
from epdserve.rpc import common_pb2, serve_pb2
from tests.engine.test_grammar_compile import _run


def _enum(n: int, tag: str) -> str:
    return json.dumps({"type": "object", "properties": {"a": {"enum": [f"{tag}-{i}" for i in range(n)]}},
                       "required": ["a"]})


@pytest.fixture(scope="module")
def llm(qwen2_vl_tiny):
    # 600 KB of cache, 200 KB per grammar: a 1,200-value enum compiles to ~95 KB here, a 3,000-value one to ~260 KB
    llm = LLM(model=qwen2_vl_tiny, device="cpu", kv_cache_bytes=4 << 20, grammar_cache_bytes=600_000,
              max_grammar_bytes=200_000)
    yield llm
    llm.engine.close()


def test_a_grammar_over_the_limit_fails_its_request_alone_and_is_not_cached(llm):
    eng = llm.engine
    big = StructuredOutput("json", _enum(3000, "big"))
    eng.add_request(eng.build_request("n", "a neighbour", None, SamplingParams(max_tokens=6, ignore_eos=True)))
    eng.add_request(eng.build_request("big", "huge enum", None, SamplingParams(max_tokens=8, structured=big)))
    outs = _run(eng, lambda outs: all(k in outs and outs[k][-1].finished for k in ("n", "big")))
    bad, n = outs["big"][-1], outs["n"][-1]
    assert bad.finish_reason == "error" and not bad.retryable and list(bad.token_ids) == []
    assert "MiB, over this engine's limit of" in bad.error and "--max-grammar-mb" in bad.error
    assert n.finish_reason == "length" and len(n.token_ids) == 6
    assert eng.grammars.cached(big) is None


def test_the_grammar_cache_is_bounded_in_bytes_least_recently_used_first(llm):
    b = llm.engine.grammars
    schemas = [StructuredOutput("json", _enum(1200, f"s{i}")) for i in range(6)]
    sizes = []
    for c in schemas:
        sizes.append(b.compile(c).memory_size_bytes)
        assert b.cache_bytes <= 600_000
    assert all(s <= 200_000 for s in sizes) and sum(sizes) > 600_000  # more than fits: some were evicted
    kept = [b.cached(c) is not None for c in schemas]
    assert kept[-1] and not kept[0]  # the newest stays, the oldest went first
    assert kept == sorted(kept)  # evicted in order of last use


def test_a_schema_over_the_byte_limit_is_refused_before_it_is_parsed():
    limits = InputLimits(max_structured_output_bytes=10_000)
    big = _enum(2000, "x")
    req = serve_pb2.GenerateRequest(prompt="p", sampling=common_pb2.SamplingParams(
        max_tokens=4, structured=common_pb2.StructuredOutput(json_schema=big)))
    with pytest.raises(LimitError) as e:
        check_generate_request(req, limits)
    assert e.value.http_status == 400 and e.value.limit == "max_structured_output_bytes"
    assert f"json_schema is {len(big)} bytes, over the limit of 10000 (--max-structured-output-bytes)" in e.value.message
    choices = common_pb2.SamplingParams(structured=common_pb2.StructuredOutput(
        choice=common_pb2.ChoiceList(choices=["x" * 6000, "y" * 6000])))
    with pytest.raises(LimitError, match="choice is 12000 bytes"):
        check_generate_request(serve_pb2.GenerateRequest(prompt="p", sampling=choices), limits)
    check_generate_request(serve_pb2.GenerateRequest(prompt="p", sampling=common_pb2.SamplingParams(
        structured=common_pb2.StructuredOutput(json_schema=_enum(10, "x")))), limits)
    # the HTTP front: refused with the field named, before xgrammar parses it
    body = ChatCompletionRequest.model_validate({
        "model": "m", "messages": [{"role": "user", "content": "hi"}],
        "response_format": {"type": "json_schema", "json_schema": {"name": "s", "schema": json.loads(big)}}})
    with pytest.raises(ApiError) as e:
        sampling(body, 512, 8, max_structured_bytes=10_000)
    assert e.value.status == 400 and "over the limit of 10000" in str(e.value.message)


def test_a_compile_over_its_time_budget_fails_alone_and_its_process_goes(llm):
    """The engine compiles in a child process (engine/grammar_process.py); a compile past
    --grammar-compile-timeout-s fails its request alone, naming the flag, is never cached, and its
    process is killed; the next compile gets a fresh process and a neighbour decodes throughout."""
    eng = llm.engine
    gc = eng.grammar_compiles
    slow = StructuredOutput("json", _enum(30_000, "slow"))  # seconds of compile here
    gc.timeout_s = 0.3
    try:
        eng.add_request(eng.build_request("n", "a neighbour", None, SamplingParams(max_tokens=6, ignore_eos=True)))
        eng.add_request(eng.build_request("slow", "huge enum", None, SamplingParams(max_tokens=8, structured=slow)))
        outs = _run(eng, lambda outs: all(k in outs and outs[k][-1].finished for k in ("n", "slow")))
    finally:
        gc.timeout_s = 60.0
    bad, n = outs["slow"][-1], outs["n"][-1]
    assert bad.finish_reason == "error" and not bad.retryable and list(bad.token_ids) == []
    assert "did not compile within 0.3 s (--grammar-compile-timeout-s)" in bad.error, bad.error
    assert n.finish_reason == "length" and len(n.token_ids) == 6
    proc = gc.processes["large"]
    assert eng.grammars.cached(slow) is None and proc._proc is None  # killed, nothing kept
    starts = proc.starts
    ok = StructuredOutput("json", _enum(1200, "ok"))  # the large lane again
    eng.add_request(eng.build_request("ok", "pick one", None, SamplingParams(max_tokens=40, structured=ok)))
    done = _run(eng, lambda outs: "ok" in outs and outs["ok"][-1].finished)["ok"][-1]
    assert done.error is None and json.loads(done.text)["a"].startswith("ok-"), done.text
    assert proc.starts == starts + 1 and eng.grammars.cached(ok) is not None
