"""Client -> scheduler -> coupled EPD instances (real LLMEngines behind real gRPC servers)."""
from concurrent.futures import ThreadPoolExecutor

import grpc
import pytest
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

from epdserve import Client, SamplingParams
from epdserve.client import EPDServeError, MediaKey
from tests.scheduler.harness import PH, image, mixed_prompts, start_scheduler, wait_until


def test_health_serving_and_reflection_lists_services(scheduler):
    with Client(scheduler.address, timeout=30) as c:
        assert c.health() == "SERVING"
        assert c.health("epdserve.v1.EPDServe") == "SERVING"
        info = c.server_info()
        assert info.mode == "monolithic" and {i.instance_id for i in info.instances} == {"epd0", "epd1"}
    with grpc.insecure_channel(scheduler.address) as ch:
        stub = reflection_pb2_grpc.ServerReflectionStub(ch)
        resp = next(iter(stub.ServerReflectionInfo(iter([reflection_pb2.ServerReflectionRequest(list_services="")]))))
    names = {s.name for s in resp.list_services_response.service}
    assert {"epdserve.v1.EPDServe", "grpc.health.v1.Health"} <= names
    assert "epdserve.v1.Registry" not in names  # an internal service: only on the internal port
    with grpc.insecure_channel(scheduler.server.internal_address) as ch:
        stub = reflection_pb2_grpc.ServerReflectionStub(ch)
        resp = next(iter(stub.ServerReflectionInfo(iter([reflection_pb2.ServerReflectionRequest(list_services="")]))))
    assert "epdserve.v1.Registry" in {s.name for s in resp.list_services_response.service}


def test_16_concurrent_mixed_requests_match_offline_greedy(scheduler, two_instances, offline):
    prompts = mixed_prompts(16)
    with Client(scheduler.address, timeout=120) as c, ThreadPoolExecutor(16) as pool:
        results = list(pool.map(lambda p: c.generate(p[0], images=p[1], max_tokens=12, temperature=0.0), prompts))
    for (prompt, images), r in zip(prompts, results):
        assert r.token_ids == offline(prompt, images, 12)
        assert r.finish_reason in ("length", "stop") and r.usage.output_tokens == len(r.token_ids)
        assert r.usage.vision_tokens > 0 if images else r.usage.vision_tokens == 0
        assert len(r.media_keys) == len(images)
        assert r.timing.arrival <= r.timing.dispatched <= r.timing.first_token <= r.timing.finished
    assert all(len(i.requests_seen) > 0 for i in two_instances)  # both instances were used


def test_corrupt_image_fails_only_its_request(scheduler):
    good = [(f"Look {PH} here", [image(i)]) for i in range(3)]
    with Client(scheduler.address, timeout=60) as c, ThreadPoolExecutor(4) as pool:
        futs = [pool.submit(c.generate, p, images=im, max_tokens=4) for p, im in good]
        bad = pool.submit(c.generate, f"Broken {PH}", images=[image(0)[:40]], max_tokens=4)
        with pytest.raises(EPDServeError) as e:
            bad.result()
        assert e.value.code == grpc.StatusCode.INVALID_ARGUMENT and "image 1 is not a readable image" in e.value.details
        assert all(f.result().finish_reason == "length" for f in futs)


def test_bad_requests_are_invalid_argument(scheduler):
    with Client(scheduler.address, timeout=30) as c:
        for kwargs in (dict(prompt="hi", top_p=2.0), dict(prompt=f"two {PH}{PH}", images=[image(1)]),
                       dict(prompt=f"x {PH}", images=[MediaKey("nope:123")]), dict(prompt=[10**9]),
                       dict(prompt="")):
            with pytest.raises(EPDServeError) as e:
                c.generate(**kwargs)
            assert e.value.code == grpc.StatusCode.INVALID_ARGUMENT, kwargs
        with pytest.raises(TypeError):
            c.generate("hi", not_a_sampling_field=1)


def test_media_by_key_same_image_twice_and_chat(qwen2_vl_tiny, two_instances, offline):
    # one instance: its engine's feature cache is the "store" here (no MM Store in this test)
    sched = start_scheduler(qwen2_vl_tiny, two_instances[:1])
    prompt = f"Key test {PH} please"
    try:
        with Client(sched.address, timeout=60) as c:
            first = c.generate(prompt, images=[image(5)], max_tokens=6)
            twice = c.generate(prompt, images=[image(5)], max_tokens=6)
            again = c.generate(prompt, images=[MediaKey(first.media_keys[0])], max_tokens=6)
    finally:
        sched.stop()
    assert again.token_ids == twice.token_ids == first.token_ids == offline(prompt, [image(5)], 6)
    assert first.usage.cached_vision_tokens == 0
    assert twice.usage.cached_vision_tokens == twice.usage.vision_tokens > 0


def test_chat_matches_offline_chat(scheduler, offline):
    with Client(scheduler.address, timeout=60) as c:
        messages = [{"role": "user", "content": [{"type": "image", "image": image(6)}, {"type": "text", "text": "Hi?"}]}]
        chat = c.chat(messages, max_tokens=6)
        ref = offline.llm.chat(messages, SamplingParams(max_tokens=6))[0]
        assert chat.token_ids == ref.outputs[0].token_ids and chat.usage.vision_tokens > 0
    # and transformers' own chat template, processor and generate agree
    hf_prompt = offline.hf.chat_prompt([{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "Hi?"}]}])
    assert chat.token_ids == offline.hf.generate(hf_prompt, [image(6)], 6)


def test_cancelled_stream_aborts_on_the_instance(scheduler, two_instances):
    with Client(scheduler.address, timeout=60) as c:
        stream = c.generate_stream("Count forever", max_tokens=400, ignore_eos=True, request_id="cancel-me")
        first = next(stream)
        assert first.token_ids and not first.finished
        stream.close()  # cancels the RPC
    wait_until(lambda: any(a.startswith("cancel-me#") for i in two_instances for a in i.aborted), what="abort")


def test_abort_rpc_ends_the_stream_with_abort(scheduler):
    with Client(scheduler.address, timeout=60) as c:
        stream = c.generate_stream("Abort me", max_tokens=400, ignore_eos=True, request_id="abort-me")
        assert next(stream).token_ids
        assert c.abort("abort-me") is True
        last = list(stream)[-1]
        assert last.finished and last.finish_reason == "abort" and last.usage.output_tokens >= 1
        assert c.abort("abort-me") is False


def test_backpressure_and_unavailable(qwen2_vl_tiny, two_instances):
    sched = start_scheduler(qwen2_vl_tiny, two_instances, max_requests_in_flight=1)
    try:
        with Client(sched.address, timeout=60) as c:
            stream = c.generate_stream("busy", max_tokens=400, ignore_eos=True)
            next(stream)
            with pytest.raises(EPDServeError) as e:
                c.generate("second", max_tokens=2)
            assert e.value.code == grpc.StatusCode.RESOURCE_EXHAUSTED
            stream.close()
    finally:
        sched.stop()
    empty = start_scheduler(qwen2_vl_tiny, [])
    try:
        # one quick retry instead of the default policy's ~23 s of backoff: the scheduler's answer is what
        # is tested here (the client's retry policy is test_client's)
        with Client(empty.address, timeout=30, retries=1, retry_backoff_s=0.05) as c:
            with pytest.raises(EPDServeError) as e:
                c.generate("anyone?", max_tokens=2)
            assert e.value.code == grpc.StatusCode.UNAVAILABLE
    finally:
        empty.stop()


def test_instance_killed_mid_run_every_request_completes(qwen2_vl_tiny, offline):
    from epdserve.metrics.serving import ServingMetrics
    from tests.scheduler.engine_instance import EngineInstance

    insts = [EngineInstance(qwen2_vl_tiny, f"k{i}").start() for i in range(2)]
    metrics = ServingMetrics()
    sched = start_scheduler(qwen2_vl_tiny, insts, observer=metrics)
    prompts = [(f"Survive {i} {PH}" if i % 2 else f"Survive {i}", [image(i)] if i % 2 else []) for i in range(6)]
    n = 64  # long enough that k0 still decodes some of its requests when it is killed
    try:
        with Client(sched.address, timeout=120) as c:
            streams = [c.generate_stream(p, images=im, max_tokens=n, ignore_eos=True) for p, im in prompts]
            got = [list(next(s).token_ids) for s in streams]  # every request is running somewhere
            insts[0].kill()
            cut = len(insts[0]._queues)  # k0's requests its engine had not finished: they must move to k1
            assert cut >= 1, "k0 finished its requests before it was killed: nothing was cut off"
            finals = []
            for s, toks in zip(streams, got):
                for d in s:
                    toks.extend(d.token_ids)
                    if d.finished:
                        finals.append(d)
        assert [f.finish_reason for f in finals] == ["length"] * len(prompts)
        for (p, im), toks, f in zip(prompts, got, finals):
            assert len(toks) == n == f.usage.output_tokens
            assert toks == offline(p, im, n, ignore_eos=True)  # resumed, never replayed: greedy output unchanged
        # each request cut off on k0 was retried on k1 (a second attempt, `<id>#2`), none failed
        retried = [r for r in insts[1].requests_seen if r.endswith("#2")]
        assert len(retried) >= cut and metrics.registry.get_sample_value("epdserve:request_retries_total") == len(retried)
        assert metrics.registry.get_sample_value("epdserve:requests_total", {"status": "ok"}) == len(prompts)
        health = {r.instance_id: r.health for r in sched.call(sched.server.registry.records)}
        assert health["k1"] == 1  # HEALTHY
    finally:
        sched.stop()
        for i in insts:
            i.stop()
