"""`epdserve launch --mode E-P-D --http-port 0` as real processes, with an API key and a cluster
token from the environment: the scheduler process serves the OpenAI API beside gRPC; a chat with
an image through the official `openai` client gives, greedy, the gRPC API's tokens and
transformers' `generate`; every scheduler→instance call carried the token; /metrics counts it."""
from __future__ import annotations

import os
import re
import urllib.error
import urllib.request

import grpc
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from epdserve.client import Client, EPDServeError
from epdserve.model.chat import chat_to_prompt
from epdserve.model.reference import ReferenceGenerator
from tests.entrypoints.http_harness import data_url
from tests.entrypoints.launch_harness import launched as launch_process
from tests.instance.harness import image

pytestmark = pytest.mark.slow

READY = re.compile(r"^epdserve ready: grpc://(?P<grpc>\S+) mode=\S+ .* http=(?P<http>\S+)")
KEY, TOKEN = "sk-launch-test", "launch-cluster-token"


@pytest.fixture(scope="module")
def launched(qwen2_vl_tiny):
    args = ["--mode", "E-P-D", "--model", str(qwen2_vl_tiny), "--kv-cache-mb", "16", "--feature-wait-s", "20",
            "--http-port", "0"]
    env = dict(os.environ, EPDSERVE_API_KEY=KEY, EPDSERVE_CLUSTER_TOKEN=TOKEN)
    with launch_process(args, env, READY, secrets=(KEY, TOKEN)) as (found, output):
        yield found, output


def test_launched_http_chat_matches_grpc_and_transformers(launched, qwen2_vl_tiny):
    found, _ = launched
    img = image(42, 84, 56)
    text = "Describe the picture."
    with openai.OpenAI(base_url=found["http"] + "/v1", api_key=KEY, max_retries=0, timeout=120) as oai:
        model = oai.models.list().data[0].id
        r = oai.chat.completions.create(
            model=model, temperature=0, max_tokens=8, extra_body={"ignore_eos": True, "return_token_ids": True},
            messages=[{"role": "user", "content": [{"type": "image_url", "image_url": {"url": data_url(img)}},
                                                   {"type": "text", "text": text}]}])
        with pytest.raises(openai.AuthenticationError):
            openai.OpenAI(base_url=found["http"] + "/v1", api_key="wrong", max_retries=0).models.list()
    messages = [{"role": "user", "content": [{"type": "image", "image": img}, {"type": "text", "text": text}]}]
    with Client(found["grpc"], timeout=120, api_key=KEY) as c:  # every E/P/D call carries the cluster token
        g = c.chat(messages, max_tokens=8, ignore_eos=True)
        assert all(not i.address for i in c.server_info().instances)  # addresses: token holders only
    with Client(found["grpc"], timeout=30, api_key="wrong") as c, pytest.raises(EPDServeError) as e:
        c.model_info()
    assert e.value.code == grpc.StatusCode.UNAUTHENTICATED
    gen = ReferenceGenerator(qwen2_vl_tiny)
    prompt = chat_to_prompt(gen.tokenizer, messages, True)["prompt"]
    assert r.choices[0].model_extra["token_ids"] == g.token_ids == gen.generate(prompt, [img], max_tokens=8)
    assert r.usage.prompt_tokens == g.usage.prompt_tokens and r.usage.completion_tokens == 8
    with pytest.raises(urllib.error.HTTPError) as refused:  # a keyed deployment's /metrics needs a credential
        urllib.request.urlopen(found["http"] + "/metrics", timeout=30)
    assert refused.value.code == 401
    scrape = urllib.request.Request(found["http"] + "/metrics", headers={"Authorization": f"Bearer {KEY}"})
    text = urllib.request.urlopen(scrape, timeout=30).read().decode()  # no scrape token: the single key
    samples = {(s.name, tuple(sorted(s.labels.items()))): s.value
               for fam in text_string_to_metric_families(text) for s in fam.samples}
    assert samples[("epdserve:request_success_total", (("finished_reason", "length"),))] == 2  # HTTP + gRPC
    for stage in ("queue", "encode", "prefill", "p_to_d", "first_decode"):  # E-P-D: every stage ran
        assert samples[("epdserve:request_stage_seconds_count", (("stage", stage),))] >= 1, stage
    assert samples[("epdserve:instances", (("health", "healthy"), ("roles", "D")))] == 1
