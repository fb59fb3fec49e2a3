"""Client -> scheduler -> E, P, D, D instance *processes* (epdserve.instance) sharing a real MM
Store (valkey) and a real P->D KV transfer: greedy outputs equal the offline engine's, the same
image twice is served from the MM Store, a cancelled stream frees KV on P and D, and a D killed
mid-run loses no request."""
import signal
from concurrent.futures import ThreadPoolExecutor

import grpc
import pytest

import epdserve.entrypoints.instance_cli  # noqa: F401  an import regression fails here, never skips the file
import epdserve.instance.host  # noqa: F401
from epdserve import Client
from epdserve.metrics.serving import ServingMetrics
from epdserve.rpc import instance_pb2, instance_pb2_grpc
from tests.scheduler.harness import image, instance_deployment, mixed_prompts, PH, wait_until

pytestmark = pytest.mark.slow

@pytest.fixture(scope="module")
def deployment(qwen2_vl_tiny):
    instances = (("e0", "E"), ("p0", "P"), ("d0", "D"), ("d1", "D"))
    with instance_deployment(qwen2_vl_tiny, instances, observer=ServingMetrics()) as (sched, procs, _):
        yield sched, procs


def _load(sched, iid):
    rec = sched.call(lambda: sched.server.registry.get(iid))
    with grpc.insecure_channel(rec.address) as ch:
        return instance_pb2_grpc.InstanceStub(ch).GetLoad(instance_pb2.GetLoadRequest(), timeout=10).load


def test_mixed_requests_match_offline_and_same_image_is_cached(deployment, offline):
    sched, _ = deployment
    prompts = mixed_prompts(16)
    with Client(sched.address, timeout=300) as c:
        with ThreadPoolExecutor(16) as pool:
            results = list(pool.map(lambda p: c.generate(p[0], images=p[1], max_tokens=10), prompts))
        for (prompt, images), r in zip(prompts, results):
            assert r.token_ids == offline(prompt, images, 10)
        first = c.generate(f"Twice {PH}", images=[image(99)], max_tokens=4)
        second = c.generate(f"Twice {PH}", images=[image(99)], max_tokens=4)
        assert c.server_info().mode == "E-P-D"
    assert first.token_ids == second.token_ids
    assert first.usage.cached_vision_tokens == 0 and second.usage.cached_vision_tokens == second.usage.vision_tokens > 0
    t = first.timing
    assert t.encode_end and t.prefill_start and t.first_token and t.kv_transfer_end and t.first_decode


def test_cache_salted_requests_are_exact_and_share_prefixes_under_one_salt_only(deployment, offline):
    """A request's cache salt (issue 39) keys its first KV block on P and on D alike: output is
    exact, a repeat under the salt reuses the prefix, the same prompt under another salt does not."""
    sched, _ = deployment
    prompt = ("Salted prompt: the quick brown fox jumps over the lazy dog while the cat watches from the "
              "window and the bird sings on the old oak tree in the garden behind the house " + PH)
    with Client(sched.address, timeout=300) as c:
        runs = [c.generate(prompt, images=[image(42)], max_tokens=6, ignore_eos=True, cache_salt=salt)
                for salt in ("s1", "s1", "s2")]
    want = offline(prompt, [image(42)], 6, ignore_eos=True)
    assert [r.token_ids for r in runs] == [want] * 3
    assert runs[1].usage.cached_tokens > 0 and runs[2].usage.cached_tokens == 0
    assert runs[2].media_keys != runs[0].media_keys == runs[1].media_keys  # media keyed under the salt too


def test_cancelled_stream_frees_kv_on_p_and_d(deployment):
    sched, _ = deployment
    with Client(sched.address, timeout=120) as c:
        stream = c.generate_stream(f"Cancel {PH}", images=[image(7)], max_tokens=2000, ignore_eos=True)
        next(stream)
        next(stream)
        busy = {iid: _load(sched, iid) for iid in ("p0", "d0", "d1")}
        assert any(lo.free_kv_blocks < lo.total_kv_blocks for lo in busy.values())
        stream.close()
    for iid in ("p0", "d0", "d1"):
        wait_until(lambda: (lambda lo: lo.free_kv_blocks == lo.total_kv_blocks)(_load(sched, iid)), 30,
                   f"{iid} to free its KV blocks")


def test_one_of_two_d_killed_mid_run_every_request_completes(deployment, offline):
    sched, procs = deployment
    prompts = [(f"Survive {i} {PH}" if i % 2 else f"Survive {i}", [image(i)] if i % 2 else []) for i in range(8)]
    with Client(sched.address, timeout=300) as c:
        streams = [c.generate_stream(p, images=im, max_tokens=200, ignore_eos=True) for p, im in prompts]
        got = [list(next(s).token_ids) + list(next(s).token_ids) for s in streams]  # all past the first decode
        # the router may place all eight on one D (cache-aware routing): kill whichever decodes more
        running = {iid: _load(sched, iid).running_requests for iid in ("d0", "d1")}
        victim = max(running, key=running.get)
        survivor = "d1" if victim == "d0" else "d0"
        assert running[victim] > 0  # the victim decodes some of them: killing it cuts them off
        procs[victim].send_signal(signal.SIGKILL)
        for s, toks in zip(streams, got):
            for d in s:
                toks.extend(d.token_ids)
    for (p, im), toks in zip(prompts, got):
        assert toks == offline(p, im, 200, ignore_eos=True)
    metrics = sched.server.observer
    assert metrics.registry.get_sample_value("epdserve:request_retries_total") >= 1  # the victim's requests moved
    assert sched.call(lambda: sched.server.registry.get(survivor).health) == 1  # HEALTHY


def test_registration_refuses_a_decode_instance_whose_kv_cannot_pair(deployment):
    """Each P and D registers its KV layout (epdserve/kv_layout.py); a D whose KV dtype differs from
    the registered P's is refused at Register, the message naming both records, and the roster
    keeps serving (issue 48 item 2)."""
    sched, _ = deployment
    recs = sched.call(lambda: {i: sched.server.registry.get(i) for i in ("e0", "p0", "d0")})
    assert recs["e0"].kv_layout is None
    p, d = recs["p0"].kv_layout, recs["d0"].kv_layout
    assert p == d and p.degree == 1 and p.dtype == "float32" and p.quantization == ""
    impostor = recs["d0"].to_proto()
    impostor.instance_id = "d-bf16"
    impostor.kv_layout.dtype = "bfloat16"
    with grpc.insecure_channel(sched.server.internal_address) as ch:
        with pytest.raises(grpc.RpcError) as e:
            instance_pb2_grpc.RegistryStub(ch).Register(instance_pb2.RegisterRequest(instance=impostor), timeout=10)
    assert e.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    msg = e.value.details()
    assert "d-bf16 cannot pair with p0" in msg and "dtype differs (float32 vs bfloat16)" in msg
    assert f"P: {p.describe()}" in msg and "D: TP1" in msg and ", bfloat16, weights unquantized" in msg
    assert sched.call(lambda: sched.server.registry.get("d-bf16")) is None
    with Client(sched.address, timeout=120) as c:
        assert c.generate(f"Still paired {PH}", images=[image(5)], max_tokens=3).usage.output_tokens == 3
