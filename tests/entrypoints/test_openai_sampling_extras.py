"""Issue 40 items 2-4 through the official `openai` client, in-process deployments of real
`InstanceHost`s (monolithic: one EPD instance; P-D: P samples the first token, D the rest over a
real gloo KV pair): greedy output with logit_bias and the repetition, frequency and presence
penalties equals transformers' `generate` with the equivalent logits processors (transformers'
`RepetitionPenaltyLogitsProcessor`; bias and OpenAI's presence/frequency written here after
vLLM's definition) — in P-D the penalties on D count P's first token; logprobs and top_logprobs
equal log_softmax of transformers' `output_logits` to 1e-4 in fp32, the first token's included
(P's in P-D), streamed with their tokens too; n=4 gives 4 choices, each the greedy output at
temperature 0, seeded sampling reproducible, the prompt prefilled once; the gRPC client carries
the same keywords, and a request resumed after its first token continues the whole request's
output (the resumed token counts as output); docs/openai-sampling.md's examples run as pasted."""
from __future__ import annotations

import asyncio
import re
import subprocess
import sys
from pathlib import Path

import grpc
import openai
import pytest
import torch
from transformers import LogitsProcessor, LogitsProcessorList, RepetitionPenaltyLogitsProcessor

from epdserve import AsyncClient, Client
from epdserve.model.loader import load_checkpoint
from epdserve.rpc import common_pb2, serve_pb2, serve_pb2_grpc
from tests.entrypoints.http_harness import metered_deployment
from tests.instance.harness import wait_until

MODES = {"monolithic": (("epd0", "EPD"),), "P-D": (("p0", "P+E"), ("d0", "D"))}
PROMPT = [11, 52, 93, 52, 11, 7, 300, 52, 18, 44]  # token ids: the test and transformers see the same prompt
MAX = 12
BLOCK = 16  # the CPU platform's KV block size


@pytest.fixture(scope="module", params=sorted(MODES))
def deployment(request, qwen2_vl_tiny):
    with metered_deployment(qwen2_vl_tiny, MODES[request.param]) as (sched, front), \
            openai.OpenAI(base_url=front.base_url, api_key="none", max_retries=0, timeout=120) as oai:
        yield sched, oai


@pytest.fixture(scope="module")
def hf(qwen2_vl_tiny):
    return load_checkpoint(qwen2_vl_tiny, "cpu", torch.float32).model


class BiasProcessor(LogitsProcessor):
    """OpenAI's logit_bias: added to the logits."""

    def __init__(self, bias: dict[int, float]):
        self.bias = bias

    def __call__(self, input_ids, scores):
        for t, b in self.bias.items():
            scores[:, t] += b
        return scores


class OpenAIPenalties(LogitsProcessor):
    """OpenAI's (and vLLM's) presence / frequency penalties over the generated tokens only:
    logit[t] -= frequency * count(t) + presence * (count(t) > 0)."""

    def __init__(self, prompt_len: int, presence: float, frequency: float):
        self.prompt_len, self.presence, self.frequency = prompt_len, presence, frequency

    def __call__(self, input_ids, scores):
        out = input_ids[:, self.prompt_len:]
        counts = torch.zeros_like(scores).scatter_add_(1, out, torch.ones_like(out, dtype=scores.dtype))
        return scores - self.frequency * counts - self.presence * (counts > 0).to(scores.dtype)


def reference(hf, presence=0.0, frequency=0.0, repetition=1.0, bias=None):
    """transformers' greedy output and raw logits [steps, V] with vLLM's order of processors."""
    procs = LogitsProcessorList()
    if bias:
        procs.append(BiasProcessor(bias))
    if repetition != 1.0:
        procs.append(RepetitionPenaltyLogitsProcessor(repetition))
    if presence or frequency:
        procs.append(OpenAIPenalties(len(PROMPT), presence, frequency))
    ids = torch.tensor([PROMPT])
    with torch.inference_mode():
        out = hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=MAX, do_sample=False,
                          logits_processor=procs, output_logits=True, return_dict_in_generate=True,
                          eos_token_id=None, pad_token_id=0)
    return out.sequences[0, len(PROMPT):].tolist(), torch.cat(out.logits).float()


def _prefix_queried(sched) -> int:
    """Prompt tokens the prefilling instances looked up in their prefix caches (their heartbeats' figure)."""
    return sum(r.load.prefix_queried_tokens for r in sched.call(sched.server.registry.records) if "P" in r.roles)


def _kv_sent(sched) -> int:
    """P->D KV bytes sent so far, as the instances' heartbeats after now report them."""
    registry = sched.server.registry
    for _ in range(2):
        since = sched.call(registry.clock)
        wait_until(lambda: all(r.last_heartbeat > since for r in sched.call(registry.records)), 30, "heartbeats")
    return sum(r.load.kv_sent_bytes for r in sched.call(registry.records))


def completion(oai, **kw):
    extra = {"ignore_eos": True, "return_token_ids": True, **kw.pop("extra_body", {})}
    kw.setdefault("temperature", 0)
    kw.setdefault("prompt", PROMPT)
    kw.setdefault("max_tokens", MAX)
    return oai.completions.create(model="tiny-vl", extra_body=extra, **kw)


# Each case against the same bias without its penalty (the tiny model's greedy output repeats no
# token by itself: the bias makes token 52 come back, the penalty must push it away again). In
# P-D, 52 is P's first token: D's penalties only see it if it crossed the handoff.
PENALTIES = {
    "bias": (dict(bias={52: 3.0, 300: -100.0}), {}),
    "repetition": (dict(bias={52: 5.0}, repetition=1.5), dict(bias={52: 5.0})),
    "presence": (dict(bias={52: 3.0}, presence=1.5), dict(bias={52: 3.0})),
    "frequency": (dict(bias={52: 5.0}, frequency=0.5), dict(bias={52: 5.0})),
}


@pytest.mark.parametrize("name", sorted(PENALTIES))
def test_greedy_with_penalties_and_bias_equals_transformers(deployment, hf, name):
    sched, oai = deployment
    case, without = PENALTIES[name]
    want, _ = reference(hf, **case)
    assert want != reference(hf, **without)[0]  # the processor changes this output: the comparison means something
    body = {"repetition_penalty": case.get("repetition", 1.0)}
    r = completion(oai, presence_penalty=case.get("presence", 0.0), frequency_penalty=case.get("frequency", 0.0),
                   logit_bias={str(t): b for t, b in case.get("bias", {}).items()} or None, extra_body=body)
    assert r.choices[0].model_extra["token_ids"] == want
    with Client(sched.address, timeout=120) as c:  # the gRPC front: the same keywords, the same tokens
        g = c.generate(PROMPT, max_tokens=MAX, ignore_eos=True, presence_penalty=case.get("presence", 0.0),
                       frequency_penalty=case.get("frequency", 0.0), repetition_penalty=case.get("repetition", 1.0),
                       logit_bias=case.get("bias", {}))
    assert g.token_ids == want


def test_logprobs_equal_transformers_raw_logprobs(deployment, hf):
    sched, oai = deployment
    want, logits = reference(hf)
    lp = torch.log_softmax(logits, dim=-1)
    r = oai.chat.completions.create(model="tiny-vl", messages=[{"role": "user", "content": "x"}], max_tokens=1,
                                    logprobs=True, top_logprobs=3)  # the chat shape parses
    entry = r.choices[0].logprobs.content[0]
    assert len(entry.top_logprobs) == 3 and entry.top_logprobs[0].logprob >= entry.top_logprobs[2].logprob
    with Client(sched.address, timeout=120) as c:
        g = c.generate(PROMPT, max_tokens=MAX, ignore_eos=True, logprobs=5)
    assert g.token_ids == want and len(g.logprobs) == MAX  # the first token's (P's in P-D) included
    for i, (t, got) in enumerate(zip(want, g.logprobs)):
        assert abs(got.logprob - lp[i, t].item()) < 1e-4
        top = lp[i].topk(5)
        assert got.top_token_ids == top.indices.tolist()
        torch.testing.assert_close(torch.tensor(got.top_logprobs), top.values, atol=1e-4, rtol=0)
    r = completion(oai, logprobs=2)  # the completions shape
    ch = r.choices[0]
    assert ch.model_extra["token_ids"] == want
    assert [round(v, 4) for v in ch.logprobs.token_logprobs] == [round(x.logprob, 4) for x in g.logprobs]
    assert len(ch.logprobs.top_logprobs) == MAX and all(len(d) <= 2 for d in ch.logprobs.top_logprobs)
    stream = completion(oai, logprobs=1, stream=True)  # streamed with their tokens
    streamed = [(ids, c.choices[0].logprobs.token_logprobs) for c in stream if c.choices
                for ids in [c.choices[0].model_extra.get("token_ids") or []] if ids]
    assert [t for ids, _ in streamed for t in ids] == want
    assert all(len(ids) == len(lps) for ids, lps in streamed)
    assert [v for _, lps in streamed for v in lps] == pytest.approx([x.logprob for x in g.logprobs], abs=1e-4)


def test_n_choices(deployment):
    sched, oai = deployment
    greedy = completion(oai).choices[0].model_extra["token_ids"]
    r = completion(oai, n=4)
    assert [c.index for c in r.choices] == [0, 1, 2, 3]
    assert all(c.model_extra["token_ids"] == greedy for c in r.choices)
    assert r.usage.completion_tokens == 4 * MAX
    long = [(7 * i + 3) % 1900 for i in range(100)]  # 100 tokens: whole blocks the siblings can reuse
    _kv_sent(sched)  # the heartbeats after the requests above
    before = _prefix_queried(sched)
    r = oai.completions.create(model="tiny-vl", prompt=long, max_tokens=2, temperature=0, n=4)
    assert r.usage.prompt_tokens == 100 and r.usage.completion_tokens == 8  # the prompt counts once (OpenAI's usage)
    # prefilled once: one sequence group, its prompt scheduled (and looked up) once, not once per choice
    wait_until(lambda: _prefix_queried(sched) - before >= 100, 30, "prefix lookups reported")
    _kv_sent(sched)  # two more heartbeats: nothing else came
    assert _prefix_queried(sched) - before == 100
    if any(rec.roles == "D" for rec in sched.call(sched.server.registry.records)):  # P-D: one KV transfer, then blocks
        before = _kv_sent(sched)
        completion(oai, prompt=long[::-1], max_tokens=2)
        one = _kv_sent(sched) - before  # the whole prompt's KV (7 blocks)
        completion(oai, prompt=[t + 1 for t in long], max_tokens=2, n=4)
        four = _kv_sent(sched) - before - one
        assert one > 0 and four == one  # one KV transfer for the four choices
    chunks = list(oai.chat.completions.create(model="tiny-vl", messages=[{"role": "user", "content": "hi"}], n=2,
                                              max_tokens=3, stream=True, stream_options={"include_usage": True},
                                              extra_body={"ignore_eos": True}))
    assert {c.choices[0].index for c in chunks if c.choices} == {0, 1}  # both choices streamed, by index
    assert chunks[-1].usage.completion_tokens == 6

    def sampled():
        out = oai.chat.completions.create(model="tiny-vl", messages=[{"role": "user", "content": "pick"}], n=4,
                                          max_tokens=8, temperature=1.0, seed=123, extra_body={"ignore_eos": True})
        return [c.message.content for c in sorted(out.choices, key=lambda c: c.index)]

    first = sampled()
    assert len(first) == 4 and len(set(first)) > 1  # each choice its own generator (seed + index)
    assert sampled() == first  # ... and a seeded request reproduces
    with Client(sched.address, timeout=120) as c:  # gRPC: the client's n, the same seeds as HTTP's
        assert [g.token_ids for g in c.generate_choices(PROMPT, n=3, max_tokens=MAX, ignore_eos=True)] == [greedy] * 3
        grpc_sampled = c.generate_choices(PROMPT, n=3, max_tokens=MAX, ignore_eos=True, temperature=1.0, seed=9)
    http_sampled = completion(oai, n=3, temperature=1.0, seed=9)
    assert [g.token_ids for g in grpc_sampled] == [ch.model_extra["token_ids"] for ch in http_sampled.choices]

    async def async_choices():
        async with AsyncClient(sched.address, timeout=120) as c:
            return await c.generate_choices(PROMPT, n=3, max_tokens=MAX, ignore_eos=True, temperature=1.0, seed=9,
                                            logprobs=0)
    got = asyncio.run(async_choices())
    assert [g.token_ids for g in got] == [g.token_ids for g in grpc_sampled]
    assert all(len(g.logprobs) == MAX for g in got)


def test_what_remains_refused_names_its_field(deployment):
    _, oai = deployment
    with pytest.raises(openai.BadRequestError, match="best_of"):
        completion(oai, n=2, extra_body={"best_of": 3})
    with pytest.raises(openai.BadRequestError, match="top_logprobs"):
        oai.chat.completions.create(model="tiny-vl", messages=[{"role": "user", "content": "x"}], top_logprobs=2)
    with pytest.raises(openai.BadRequestError, match="presence_penalty"):
        completion(oai, presence_penalty=2.5)
    with pytest.raises(openai.BadRequestError, match="logit_bias"):
        completion(oai, logit_bias={"99999999": 1.0})


DOC = Path(__file__).resolve().parents[2] / "docs" / "openai-sampling.md"


def test_docs_examples_run_as_pasted(deployment):
    sched, oai = deployment
    blocks = re.findall(r"```python\n(.*?)```", DOC.read_text(), re.S)
    assert len(blocks) == 2
    subs = {"http://127.0.0.1:8000/v1": str(oai.base_url).rstrip("/"), "/tmp/demo": "tiny-vl",
            "127.0.0.1:50051": sched.address}
    outs = []
    for code in blocks:
        for a, b in subs.items():
            code = code.replace(a, b)
        r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
        assert r.returncode == 0, r.stderr[-3000:]
        outs.append(r.stdout.splitlines())
    http, grpc_ = outs
    assert [line.split()[0] for line in http[:3]] == ["0", "1", "2"]  # n=3 choices, each with its logprobs
    assert "completion_tokens=24" in http[3], http
    assert grpc_ and grpc_[0].startswith("["), grpc_


def test_a_resumed_request_counts_its_resumed_tokens_as_output(deployment, hf):
    """gRPC `resume_token_ids` (a client resuming after its scheduler was lost; the scheduler's own
    retries take the same path): the tokens already received count as output for the penalties,
    so the continuation is the rest of the whole request's output."""
    sched, _ = deployment
    case = dict(bias={52: 3.0}, presence=1.5)
    want, _ = reference(hf, **case)
    assert want[0] == 52  # without the resumed token counted, 52 would come back at once
    req = serve_pb2.GenerateRequest(sampling=common_pb2.SamplingParams(
        max_tokens=MAX, ignore_eos=True, presence_penalty=1.5, logit_bias={52: 3.0}))
    req.prompt_token_ids.ids.extend(PROMPT)
    req.resume_token_ids.extend(want[:1])
    with grpc.insecure_channel(sched.address) as ch:
        out = serve_pb2_grpc.EPDServeStub(ch).Generate(req, timeout=120)
    assert list(out.token_ids) == want[1:]
