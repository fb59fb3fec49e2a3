"""Instances driven over gRPC like the scheduler drives them: an EP host (co-located E + P workers,
disjoint cores), a D host and a coupled PD host, with a real MM Store and real gloo KV pairs.
Greedy outputs are compared with transformers' generate."""
from __future__ import annotations

import os
from concurrent.futures import ThreadPoolExecutor

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

from epdserve.instance.config import InstanceConfig
from epdserve.instance.host import InstanceHost
from epdserve.model.reference import ReferenceGenerator
from epdserve.rpc import common_pb2, instance_pb2
from epdserve.transfer.mm_store.server import LocalRedisServer
from tests.instance.harness import (PH, DecodeCall, Prepared, encode, image, run_disaggregated, status, stub,
                                    wait_until)

GREEDY = common_pb2.SamplingParams(max_tokens=8, ignore_eos=True)


@pytest.fixture(scope="module")
def redis():
    with LocalRedisServer() as server:
        yield server


@pytest.fixture(scope="module")
def hosts(qwen2_vl_tiny, redis):
    started = []
    try:
        for roles in ("EP", "D", "PD"):
            cfg = InstanceConfig(roles=roles, model=str(qwen2_vl_tiny), mm_store=redis.url, kv_cache_bytes=4 << 20,
                                 feature_wait_s=5.0)
            started.append(InstanceHost(cfg).start())
        yield dict(zip(("EP", "D", "PD"), started))
    finally:
        for h in started:
            h.stop()


@pytest.fixture(scope="module")
def ref(qwen2_vl_tiny):
    return ReferenceGenerator(qwen2_vl_tiny)


@pytest.fixture(scope="module")
def stubs(hosts):
    return {k: stub(f"127.0.0.1:{h.port}") for k, h in hosts.items()}


def prep(ref, hosts, prompt, images, **kw):
    return Prepared(ref.processor, hosts["EP"].status().media_namespace, prompt, images, **kw)


def free_blocks(s) -> tuple[int, int]:
    load = status(s).load
    return load.free_kv_blocks, load.total_kv_blocks


def all_free(s) -> bool:
    """Every KV block free, from one GetLoad (free and total as of the same moment)."""
    free, total = free_blocks(s)
    return free == total


def test_colocated_workers_get_disjoint_cores(hosts):
    e, p = hosts["EP"].workers
    assert (e.role, p.role) == ("E", "P")
    if len(os.sched_getaffinity(0)) >= 2:
        assert e.bound_cores and p.bound_cores and not set(e.bound_cores) & set(p.bound_cores)
    else:
        assert e.bound_cores == p.bound_cores


def test_e_p_d_concurrent_requests_match_reference(hosts, stubs, ref):
    p_status = status(stubs["EP"])
    assert p_status.roles == "EP" and p_status.kv_endpoint.port > 0 and p_status.media_namespace
    cases = [(f"Text only {i}", []) for i in range(2)] + [
        (f"One {PH} image", [image(1)]), (f"Two {PH} and {PH}", [image(2), image(3, 56, 56)])]
    runs_before = status(stubs["EP"]).load.images_encoded
    vision_before = status(stubs["EP"]).load.vision_seconds

    def one(i):
        prompt, images = cases[i]
        return run_disaggregated(stubs["EP"], stubs["EP"], stubs["D"], f"cc-{i}", prep(ref, hosts, prompt, images),
                                 GREEDY, p_status)

    with ThreadPoolExecutor(len(cases)) as pool:
        results = list(pool.map(one, range(len(cases))))
    for (prompt, images), (tokens, pre, last, enc) in zip(cases, results):
        assert tokens == ref.generate(prompt, images, max_tokens=8)
        assert last.finished and last.finish_reason == "length"
        assert list(pre.recomputed_keys) == []  # features came from E through the store
        assert pre.num_cached_vision_tokens == pre.num_vision_tokens
        if images:
            assert not any(m.already_stored for m in enc.media)
    assert status(stubs["EP"]).load.images_encoded - runs_before == 3
    assert status(stubs["EP"]).load.vision_seconds > vision_before  # the controller's busy term for E
    assert wait_until(lambda: all_free(stubs["D"]), what="D blocks freed")


def test_prefill_recomputes_features_nobody_sent(hosts, stubs, ref):
    prompt, images = f"Recompute {PH} now", [image(11)]
    req = prep(ref, hosts, prompt, images, expect_features=False)
    tokens, pre, _, _ = run_disaggregated(stubs["EP"], stubs["EP"], stubs["D"], "recompute", req, GREEDY,
                                          status(stubs["EP"]), encode_first=False)
    assert tokens == ref.generate(prompt, images, max_tokens=8)
    assert list(pre.recomputed_keys) == [req.refs[0].key] and pre.num_cached_vision_tokens == 0


def test_coupled_pd_uses_features_from_a_separate_encoder(hosts, stubs, ref):
    prompt, images = f"Coupled {PH} run", [image(21)]
    req = prep(ref, hosts, prompt, images)
    pd_id = status(stubs["PD"]).instance_id
    enc = encode(stubs["EP"], "pd-1", req, pd_id)
    assert [m.num_tokens for m in enc.media] == [req.num_vision_tokens]
    deltas = list(stubs["PD"].Generate(instance_pb2.InstanceGenerateRequest(
        request_id="pd-1", prompt_token_ids=req.token_ids, media=req.refs, sampling=GREEDY), timeout=60))
    tokens = [t for d in deltas for t in d.token_ids]
    assert tokens == ref.generate(prompt, images, max_tokens=8)
    assert deltas[-1].finished and deltas[-1].num_cached_vision_tokens == req.num_vision_tokens
    again = encode(stubs["EP"], "pd-2", req, pd_id)  # the same image again: the encoder does not run
    assert [m.already_stored for m in again.media] == [True]


def test_cancelled_decode_frees_blocks_on_p_and_d(hosts, stubs, ref):
    req = prep(ref, hosts, f"Long {PH} story", [image(31)])
    p_status = status(stubs["EP"])
    encode(stubs["EP"], "cancel-1", req, p_status.instance_id)
    sampling = common_pb2.SamplingParams(max_tokens=400, ignore_eos=True)
    dec = DecodeCall(stubs["D"], "cancel-1", req, sampling, p_status)
    free, total = free_blocks(stubs["D"])
    assert free < total  # reserved for prompt + max_tokens
    pre = stubs["EP"].Prefill(instance_pb2.PrefillRequest(request_id="cancel-1", prompt_token_ids=req.token_ids,
                                                          media=req.refs, sampling=sampling, decode=dec.reservation))
    dec.start(pre.first_token_id, pre.rope_delta)
    first = next(dec.deltas())
    assert first.token_ids and not first.finished
    dec.call.cancel()
    for s in (stubs["D"], stubs["EP"]):
        wait_until(lambda: all_free(s), what="blocks freed after cancel")


def test_decode_call_closed_after_reserve_frees_blocks(hosts, stubs, ref):
    req = prep(ref, hosts, "Closed early", [])
    dec = DecodeCall(stubs["D"], "closed-1", req, GREEDY, status(stubs["EP"]))
    assert not all_free(stubs["D"])
    dec.close()
    assert list(dec.deltas()) == []
    wait_until(lambda: all_free(stubs["D"]), what="reservation freed")


def test_too_big_reservation_is_resource_exhausted(hosts, stubs, ref):
    req = prep(ref, hosts, "Huge", [])
    with pytest.raises(grpc.RpcError) as e:
        DecodeCall(stubs["D"], "huge-1", req, common_pb2.SamplingParams(max_tokens=30000), status(stubs["EP"]))
    assert e.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED


def test_corrupt_image_is_invalid_argument(hosts, stubs, ref):
    good = prep(ref, hosts, f"Fine {PH}", [image(41)])
    bad = instance_pb2.MediaRef(key=good.refs[0].key + "0", data=image(41)[:50], num_tokens=4, grid_thw=[1, 4, 4])
    with pytest.raises(grpc.RpcError) as e:
        stubs["EP"].Encode(instance_pb2.EncodeRequest(request_id="bad-1", media=[bad]), timeout=30)
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    with pytest.raises(grpc.RpcError) as e:
        stubs["PD"].Generate(instance_pb2.InstanceGenerateRequest(
            request_id="bad-2", prompt_token_ids=good.token_ids, media=[bad], sampling=GREEDY), timeout=30).next()
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT


def test_a_stage_the_instance_does_not_run_is_failed_precondition(stubs):
    with pytest.raises(grpc.RpcError) as e:
        stubs["D"].Encode(instance_pb2.EncodeRequest(request_id="x"), timeout=10)
    assert e.value.code() == grpc.StatusCode.FAILED_PRECONDITION


def test_health_and_reflection(hosts):
    addr = f"127.0.0.1:{hosts['D'].port}"
    with grpc.insecure_channel(addr) as ch:
        health = health_pb2_grpc.HealthStub(ch)
        for service in ("", "epdserve.v1.Instance"):
            resp = health.Check(health_pb2.HealthCheckRequest(service=service), timeout=10)
            assert resp.status == health_pb2.HealthCheckResponse.SERVING
        refl = reflection_pb2_grpc.ServerReflectionStub(ch)
        resp = next(iter(refl.ServerReflectionInfo(iter([reflection_pb2.ServerReflectionRequest(list_services="")]))))
    names = {s.name for s in resp.list_services_response.service}
    assert {"epdserve.v1.Instance", "grpc.health.v1.Health"} <= names
