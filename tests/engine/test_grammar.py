"""Structured outputs in one engine (offline `LLM`, tiny demo model): the grammar holds with
sampling too, a request that goes on past its grammar's end (ignore_eos) gets stop tokens only
and harms nothing batched with it, a compiled grammar is reused for the same schema, and a
constraint that does not compile is refused when the request is added."""
import json

import pytest

from epdserve import LLM, SamplingParams
from epdserve.engine.structured_output import StructuredOutput
from epdserve.request_errors import InvalidRequestError


@pytest.fixture(scope="module")
def llm(qwen2_vl_tiny):
    return LLM(model=qwen2_vl_tiny, device="cpu")


def test_sampled_outputs_follow_the_grammar_and_plain_neighbours_are_untouched(llm):
    choice = StructuredOutput.choice(["alpha", "beta gamma"])
    regex = StructuredOutput("regex", "[0-9]{2}-[a-z]{3}")
    alone = llm.generate(["plain neighbour"], SamplingParams(max_tokens=12, ignore_eos=True))[0].outputs[0].token_ids
    params = [SamplingParams(max_tokens=30, temperature=1.0, seed=s, structured=c)
              for s, c in enumerate([choice, regex, choice, regex])]
    params.append(SamplingParams(max_tokens=12, ignore_eos=True))
    outs = llm.generate(["pick one", "a code", "another pick", "another code", "plain neighbour"], params)
    texts = [o.outputs[0].text for o in outs]
    assert texts[0] in ("alpha", "beta gamma") and texts[2] in ("alpha", "beta gamma")
    assert all(len(t) == 6 and t[:2].isdigit() and t[2] == "-" and t[3:].isalpha() for t in (texts[1], texts[3]))
    assert all(o.outputs[0].finish_reason == "stop" for o in outs[:4])
    assert outs[4].outputs[0].token_ids == alone


def test_past_the_grammars_end_only_stop_tokens_follow(llm):
    eos = llm.engine.model.eos_token_ids
    out = llm.generate(["pick"], SamplingParams(max_tokens=10, ignore_eos=True,
                                                 structured=StructuredOutput.choice(["yes"])))[0].outputs[0]
    assert out.finish_reason == "length" and len(out.token_ids) == 10
    first_stop = next(i for i, t in enumerate(out.token_ids) if t in eos)
    assert llm.engine.tokenizer.decode(out.token_ids[:first_stop]) == "yes"
    assert all(t in eos for t in out.token_ids[first_stop:])


def test_one_compile_per_schema(llm):
    backend = llm.engine.grammars
    schema = StructuredOutput("json", json.dumps({"type": "object", "properties": {"x": {"enum": [1, 2]}},
                                                  "required": ["x"]}))
    before = backend.compiles
    llm.generate(["a", "b", "c"], SamplingParams(max_tokens=20, structured=schema))
    llm.generate(["d"], SamplingParams(max_tokens=20, structured=schema))
    assert backend.compiles == before + 1


def test_a_constraint_that_does_not_compile_is_refused_at_add(llm):
    from epdserve.engine.engine_request import EngineRequest

    bad = SamplingParams(structured=StructuredOutput("grammar", "root ::= "))
    with pytest.raises(InvalidRequestError, match="cannot be compiled"):
        llm.engine.add_request(EngineRequest("bad-grammar", [1, 2, 3], params=bad))
    assert not llm.engine.has_unfinished()
