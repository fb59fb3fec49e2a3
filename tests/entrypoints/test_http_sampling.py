"""Sampling fields and prompt shapes of the HTTP front, through the official `openai` client in
front of a real scheduler and engine instance: vLLM's `min_p` reaches the sampler (min_p=1
keeps only the top token: sampled output equals greedy; HTTP and gRPC sample alike with the same
seed; outside [0, 1] is 400); /v1/completions with a list of prompts (strings or token ids) has
one choice per prompt in the list's order, each equal to that prompt sent alone, streamed too."""
import openai
import pytest
from transformers import AutoTokenizer

from epdserve import Client
from tests.entrypoints.http_harness import RunningFront, metered_scheduler
from tests.scheduler.engine_instance import EngineInstance


@pytest.fixture(scope="module")
def served(qwen2_vl_tiny):
    inst = EngineInstance(qwen2_vl_tiny, "epd-s").start()
    sched, metrics = metered_scheduler(qwen2_vl_tiny, [inst])
    front = RunningFront(sched, metrics, served_model_name="tiny-vl")
    with openai.OpenAI(base_url=front.base_url, api_key="none", max_retries=0, timeout=120) as oai:
        yield sched, oai
    front.stop()
    sched.stop()
    inst.stop()


def _ids(oai, prompt="A min_p test", **extra):
    r = oai.completions.create(model="tiny-vl", prompt=prompt, max_tokens=8,
                               extra_body={"ignore_eos": True, "return_token_ids": True, **extra.pop("body", {})},
                               **extra)
    return r.choices[0].model_extra["token_ids"]


def test_min_p_reaches_the_sampler(served):
    sched, oai = served
    greedy = _ids(oai, temperature=0)
    assert _ids(oai, temperature=1.0, seed=11) != greedy  # plain sampling leaves the greedy path ...
    assert _ids(oai, temperature=1.0, seed=11, body={"min_p": 1.0}) == greedy  # ... min_p=1 keeps the top token
    http = _ids(oai, temperature=1.0, seed=11, body={"min_p": 0.2})
    with Client(sched.address, timeout=60) as c:
        g = c.generate("A min_p test", max_tokens=8, ignore_eos=True, temperature=1.0, seed=11, min_p=0.2)
    assert http == g.token_ids
    for bad in (-0.5, 1.5):
        with pytest.raises(openai.BadRequestError, match="min_p"):
            _ids(oai, temperature=1.0, body={"min_p": bad})


GREEDY = dict(max_tokens=6, temperature=0, extra_body={"ignore_eos": True, "return_token_ids": True})


def test_a_list_of_prompts_gets_one_choice_each_in_order(served):
    sched, oai = served
    prompts = ["The first prompt", "Second", "A third, longer prompt than the others"]
    with Client(sched.address, timeout=60) as c:
        alone = [c.generate(p, max_tokens=6, ignore_eos=True) for p in prompts]
    r = oai.completions.create(model="tiny-vl", prompt=prompts, **GREEDY)
    assert [ch.index for ch in r.choices] == [0, 1, 2]
    assert [ch.model_extra["token_ids"] for ch in r.choices] == [g.token_ids for g in alone]
    assert [ch.text for ch in r.choices] == [g.text for g in alone]
    assert r.usage.prompt_tokens == sum(g.usage.prompt_tokens for g in alone)
    assert r.usage.completion_tokens == 18
    streamed = list(oai.completions.create(model="tiny-vl", prompt=prompts, stream=True,
                                           stream_options={"include_usage": True}, **GREEDY))
    for i, g in enumerate(alone):
        mine = [ch.choices[0] for ch in streamed if ch.choices and ch.choices[0].index == i]
        assert "".join(x.text for x in mine) == g.text
        assert sum((x.model_extra["token_ids"] for x in mine), []) == g.token_ids
        assert [x.finish_reason for x in mine if x.finish_reason] == ["length"]
    assert streamed[-1].usage.completion_tokens == 18 and streamed[-1].choices == []


def test_token_id_prompts_and_an_empty_list(served):
    sched, oai = served
    ids = AutoTokenizer.from_pretrained(sched.config.model)("token ids")["input_ids"]
    with Client(sched.address, timeout=60) as c:
        want = [c.generate(p, max_tokens=6, ignore_eos=True).token_ids for p in (ids, ids[:-1])]
    r = oai.completions.create(model="tiny-vl", prompt=[ids, ids[:-1]], **GREEDY)
    assert [ch.model_extra["token_ids"] for ch in r.choices] == want
    assert [ch.index for ch in r.choices] == [0, 1] and r.usage.prompt_tokens == 2 * len(ids) - 1
    for empty in ([], [[]]):
        with pytest.raises(openai.BadRequestError, match="prompt"):
            oai.completions.create(model="tiny-vl", prompt=empty, max_tokens=2)
