"""A new grammar compiles off the engine loop (engine/grammar_compile.py), on the tiny demo model
with real xgrammar compiles: while a request's brand-new big schema compiles (held by the
compile hook until the test lets it go), a running neighbour gets a token every step and the
constrained request waits unscheduled; once compiled its greedy output equals transformers'
`generate` with xgrammar's own logits processor, token for token. A cached grammar is ready at
once (no compile); a compile that fails fails its request alone; a request aborted while its
grammar compiles is gone and the compile still lands in the cache; an engine whose only work is
a compile says so (poll soon, nothing to step now)."""
import json
import threading
import time

import pytest

from epdserve import LLM, SamplingParams
from epdserve.engine.sequence import RequestState
from epdserve.engine.structured_output import StructuredOutput
from epdserve.request_errors import InvalidRequestError

PROMPT = "Describe the animal in JSON"


def _big_schema(tag: str) -> dict:
    """Nested objects and enums (a random-weight model under the grammar reaches its end) and
    many optional enum fields (a bigger compile); `tag` makes it new to the cache."""
    extra = {f"field_{tag}_{i}": {"enum": [f"v{j}" for j in range(12)]} for i in range(40)}
    return {"type": "object",
            "properties": {"kind": {"enum": ["cat", "dog", "car", tag]},
                           "box": {"type": "object", "properties": {"w": {"enum": [1, 2, 3]}, "unit": {"enum": ["px", "cm"]}},
                                   "required": ["w", "unit"], "additionalProperties": False},
                           **extra},
            "required": ["kind", "box"], "additionalProperties": False}


@pytest.fixture(scope="module")
def llm(qwen2_vl_tiny):
    return LLM(model=qwen2_vl_tiny, device="cpu")


class Hold:
    """The compile hook: each compile waits on the worker until `release`; `entered` says one began."""

    def __init__(self):
        self.entered, self.release, self.kinds = threading.Event(), threading.Event(), []

    def __call__(self, c):
        self.kinds.append(c.kind)
        self.entered.set()
        assert self.release.wait(300), "the test never released the compile"


@pytest.fixture
def hold(llm):
    h = Hold()
    llm.engine.grammar_compiles.before_compile = h
    yield h
    h.release.set()
    llm.engine.grammar_compiles.before_compile = None


def _add(engine, rid, params, prompt=PROMPT):
    engine.add_request(engine.build_request(rid, prompt, None, params))


def _run(engine, until):
    outs = {}
    while not until(outs):
        for o in engine.step():
            outs.setdefault(o.request_id, []).append(o)
    return outs


def test_others_decode_while_a_new_grammar_compiles_and_its_output_is_exact(llm, hold, qwen2_vl_tiny):
    import xgrammar as xgr
    from xgrammar.contrib.hf import LogitsProcessor

    from epdserve.engine.grammar import tokenizer_info
    from epdserve.model.loader import eos_token_ids
    from epdserve.model.reference import ReferenceGenerator

    eng = llm.engine
    schema = _big_schema("exact")
    compiles = eng.grammars.compiles
    _add(eng, "neighbour", SamplingParams(max_tokens=40, ignore_eos=True), "a plain neighbour")
    _run(eng, lambda outs: outs.get("neighbour"))  # decoding now
    c = StructuredOutput("json", json.dumps(schema))
    _add(eng, "constrained", SamplingParams(max_tokens=120, temperature=0, structured=c))
    assert hold.entered.wait(300), "the compile never started"  # add_request returned with it held
    events = []
    for _ in range(5):  # the compile is held: the loop goes on without it
        events += [(o.request_id, len(o.new_token_ids)) for o in eng.step()]
    assert events == [("neighbour", 1)] * 5
    assert eng._seqs["constrained"].state is RequestState.WAITING and eng.has_pending_transfers()
    hold.release.set()
    outs = _run(eng, lambda outs: all(k in outs and outs[k][-1].finished for k in ("neighbour", "constrained")))
    got = outs["constrained"][-1]
    assert eng.grammars.compiles == compiles + 1 and hold.kinds == ["json"]

    ref = ReferenceGenerator(qwen2_vl_tiny)
    stops = eos_token_ids(ref.model.generation_config.eos_token_id, ref.tokenizer)
    compiler = xgr.GrammarCompiler(tokenizer_info(ref.tokenizer, ref.model.config.text_config.vocab_size, stops))
    grammar = compiler.compile_json_schema(json.dumps(schema), any_whitespace=False, strict_mode=True)
    want = ref.generate(PROMPT, [], 120, ignore_eos=False, logits_processor=[LogitsProcessor(grammar)])
    assert list(got.token_ids) == want
    assert got.finish_reason == "stop"
    assert len(outs["neighbour"][-1].token_ids) == 40

    again = eng.grammar_compiles.start(c)  # cached now: ready at once, no compile
    assert again.ready and not eng.grammar_compiles.pending and hold.kinds == ["json"]


def test_a_failed_compile_fails_its_request_alone(llm, hold):
    eng = llm.engine

    def refuse(c):
        hold(c)
        raise InvalidRequestError("the json structured output cannot be compiled: refused by the test")

    eng.grammar_compiles.before_compile = refuse
    _add(eng, "n2", SamplingParams(max_tokens=6, ignore_eos=True), "another neighbour")
    _add(eng, "bad", SamplingParams(max_tokens=20, structured=StructuredOutput("json", json.dumps(_big_schema("bad")))))
    hold.release.set()
    outs = _run(eng, lambda outs: all(k in outs and outs[k][-1].finished for k in ("n2", "bad")))
    bad, n2 = outs["bad"][-1], outs["n2"][-1]
    assert bad.finish_reason == "error" and "refused by the test" in bad.error and not bad.retryable
    assert list(bad.token_ids) == []
    assert n2.finish_reason == "length" and len(n2.token_ids) == 6


def test_a_request_aborted_while_compiling_is_gone_and_the_compile_is_kept(llm, hold):
    eng = llm.engine
    c = StructuredOutput("json", json.dumps(_big_schema("aborted")))
    _add(eng, "gone", SamplingParams(max_tokens=20, structured=c))
    assert hold.entered.wait(300)
    assert not eng.has_unfinished() and eng.has_pending_transfers()  # a worker polls, it does not spin
    eng.abort("gone")
    aborted = [o for o in eng.step() if o.request_id == "gone"]
    assert aborted and aborted[-1].finish_reason == "abort"
    hold.release.set()
    while eng.grammar_compiles.pending:
        assert eng.step() == []
    assert eng.grammars.cached(c) is not None and not eng.has_unfinished()


def test_a_constraint_that_does_not_parse_is_still_refused_at_add(llm, hold):
    with pytest.raises(InvalidRequestError, match="cannot be compiled"):
        _add(llm.engine, "unparsable", SamplingParams(structured=StructuredOutput("regex", "([a-z")))
    assert not hold.entered.is_set() and not llm.engine.grammar_compiles.pending


def test_compiles_queue_per_tenant_and_a_queued_compile_of_aborted_requests_is_dropped(llm, hold):
    """Bob's backlog of new schemas (one compiling, held, three queued) does not sit ahead of
    alice's new one: the free worker takes hers next, then bob's in his order; a queued compile
    whose request was aborted never runs."""
    from epdserve.engine.request_parts import TenantShare

    eng = llm.engine
    seen: list[str] = []

    def record(c):
        seen.append(json.loads(c.spec)["properties"]["kind"]["enum"][-1])
        hold(c)

    eng.grammar_compiles.before_compile = record
    for rid, tenant in (("bob-1", "bob"), ("bob-2", "bob"), ("bob-3", "bob"), ("bob-4", "bob"), ("alice-1", "alice")):
        req = eng.build_request(rid, PROMPT, None, SamplingParams(
            max_tokens=3, structured=StructuredOutput("json", json.dumps(_big_schema(f"q-{rid}")))))
        req.tenant = TenantShare(tenant)
        eng.add_request(req)
        if rid == "bob-1":
            assert hold.entered.wait(300)  # bob-1 compiles (held); the rest queue
    eng.abort("bob-4")
    hold.release.set()
    _run(eng, lambda outs: not eng.has_unfinished() and not eng.grammar_compiles.pending)
    assert seen == ["q-bob-1", "q-alice-1", "q-bob-2", "q-bob-3"], seen


def test_a_small_constraint_compiles_while_a_big_ones_compile_runs(llm, hold):
    """Constraints up to SMALL_SPEC_BYTES compile in a lane of their own: a small schema is compiled
    and its request served while a big schema's compile (held) still runs."""
    from epdserve.engine.grammar_compile import SMALL_SPEC_BYTES, lane

    eng = llm.engine
    big = StructuredOutput("json", json.dumps({**_big_schema("lane"), "description": "x" * SMALL_SPEC_BYTES}))
    small = StructuredOutput("regex", "[a-c]{3}")
    assert (lane(big), lane(small)) == ("large", "small")

    def hold_big(c):
        if c is big or c.spec == big.spec:
            hold(c)

    eng.grammar_compiles.before_compile = hold_big
    _add(eng, "big", SamplingParams(max_tokens=3, structured=big))
    assert hold.entered.wait(300)
    _add(eng, "small", SamplingParams(max_tokens=3, structured=small))
    outs, deadline = {}, time.monotonic() + 120  # a wait for a state, bounded: a small compile behind the big fails here
    while not ("small" in outs and outs["small"][-1].finished):
        assert time.monotonic() < deadline, "the small constraint waited behind the big one's compile"
        for o in eng.step():
            outs.setdefault(o.request_id, []).append(o)
    assert outs["small"][-1].error is None and set(outs["small"][-1].text) <= set("abc")
    assert "big" not in outs and eng.grammar_compiles.pending  # still held
    hold.release.set()
    _run(eng, lambda outs: not eng.has_unfinished() and not eng.grammar_compiles.pending)
