"""Tenants who cannot see or touch each other's work (issue 39), tried as an attacker would: a
real scheduler with a keys file (alice, bob), a real PD instance host and the HTTP front, over
loopback. Bob is the attacker; every test fails on a deployment without tenants (one key for
everyone, nothing salting the caches).

- The PIN oracle: alice's prompt holds a PIN; bob sends her prompt, and every guess of its
  prefix, and sees no cache hit (`cached_tokens` 0), where alice sees hers.
- `cache_salt`: within one tenant, requests share cached prefixes only under one salt.
- Bob's gRPC `Media.key` of alice's image answers exactly as a key never seen does.
- Bob's `Abort` of alice's request id finds nothing and her request runs on; ids are per tenant.
- A per-tenant quota: alice past hers gets 429 with Retry-After, bob is served.
- The keys file is re-read on SIGHUP (a real signal); a broken file keeps the keys in use.
"""
from __future__ import annotations

import asyncio
import http.client
import json
import os
import signal
import socket
import threading

import grpc
import openai
import pytest

from epdserve import Client
from epdserve.client import EPDServeError
from epdserve.client.messages import MediaKey
from epdserve.entrypoints.http import HttpFront, HttpOptions
from epdserve.instance.config import InstanceConfig
from epdserve.instance.host import InstanceHost
from epdserve.scheduler import SchedulerConfig, SchedulerThread
from epdserve.security.options import SchedulerSecurity
from epdserve.security.tenants import TenantKeys, cache_salt
from epdserve.transfer.mm_store.server import LocalRedisServer
from tests.instance.harness import wait_until
from tests.scheduler.harness import image
from tests.harness import PH

ALICE, BOB = "sk-alice-0b1e5a", "sk-bob-77c2d9"
# 3 full 16-token blocks and more before the PIN: a shared prefix would be a hit of >= 48 tokens
SECRET = ("You are the assistant of the bank's branch office. Never reveal the customer's data to anyone. "
          "The customer's card PIN is 4821 and the account number is 77")
GREEDY = {"max_tokens": 2, "ignore_eos": True}
UPLOAD_SHARE = 16_000  # a tenant's upload share in bytes (three files at most): a 448x448 image is over it


@pytest.fixture(autouse=True)
def _no_env_secrets(no_env_secrets):
    """Every test here runs without credentials from the environment (conftest.py)."""


@pytest.fixture(scope="module")
def keys_file(tmp_path_factory):
    path = tmp_path_factory.mktemp("keys") / "keys"
    path.write_text(f"# tenant key\nalice {ALICE}\nbob {BOB}\n")
    return path


@pytest.fixture(scope="module")
def tenants(qwen2_vl_tiny, keys_file):
    security = SchedulerSecurity(api_keys_file=str(keys_file))
    sched = SchedulerThread(SchedulerConfig(model=str(qwen2_vl_tiny), probe_interval_s=0.2, max_requests_per_tenant=1,
                                            max_sequences_per_tenant=4, upload_tenant_max_files=3, upload_tenant_max_bytes=UPLOAD_SHARE),
                            security=security)
    sched.start()
    store = LocalRedisServer().start()  # features through the MM Store: the feature cache counts its hits
    host = InstanceHost(InstanceConfig(roles="EPD", model=str(qwen2_vl_tiny), scheduler=sched.server.internal_address,
                                       kv_cache_bytes=8 << 20, mm_store=store.url)).start()
    front = HttpFront(sched.server, HttpOptions(tenants=security.tenants, metrics_token="scrape-token"))
    asyncio.run_coroutine_threadsafe(front.start(), sched.loop).result(30)
    try:
        assert host.wait_registered(30)
        wait_until(lambda: sched.call(sched.server.registry.records), what="the instance to register")
        yield sched, front
    finally:
        asyncio.run_coroutine_threadsafe(front.stop(), sched.loop).result(30)
        host.stop()
        sched.stop()
        store.stop()


def post(front, path, body, key=None, headers=None):
    host, port = front.address.rsplit(":", 1)
    conn = http.client.HTTPConnection(host, int(port), timeout=120)
    h = {"Content-Type": "application/json", **({"Authorization": f"Bearer {key}"} if key else {}), **(headers or {})}
    conn.request("POST", path, body=json.dumps(body), headers=h)
    resp = conn.getresponse()
    data = json.loads(resp.read())
    conn.close()
    return resp.status, data, resp


def cached(front, key, prompt, **extra) -> int:
    status, body, _ = post(front, "/v1/completions", {"prompt": prompt, **GREEDY, **extra}, key)
    assert status == 200, body
    return body["usage"]["prompt_tokens_details"]["cached_tokens"]


def test_the_pin_oracle_is_closed(tenants):
    front = tenants[1]
    cached(front, ALICE, SECRET)
    assert cached(front, ALICE, SECRET) >= 48  # the cache works: alice's own prefix is a hit
    assert cached(front, BOB, SECRET.replace("4821", "0000")) == 0  # bob's first probe: nothing of hers
    # each further guess hits only bob's own earlier probes: the right PIN no more than a wrong one
    seen = {guess: cached(front, BOB, SECRET.replace("4821", guess)) for guess in ("1234", "4821", "9999")}
    assert seen["4821"] == seen["1234"] == seen["9999"], seen
    with Client(tenants[0].address, timeout=120, api_key=BOB) as c:  # gRPC alike (a fresh salt: fresh probes)
        grpc_seen = {g: c.generate(SECRET.replace("4821", g), cache_salt="grpc", **GREEDY).usage.cached_tokens
                     for g in ("5555", "4821", "6666")}
    assert grpc_seen["5555"] == 0 and grpc_seen["4821"] == grpc_seen["6666"], grpc_seen
    with Client(tenants[0].address, timeout=120, api_key=ALICE) as c:  # while alice's own repeat is a hit
        assert c.generate(SECRET, **GREEDY).usage.cached_tokens > seen["4821"]


def test_cache_salt_separates_requests_of_one_tenant(tenants):
    front = tenants[1]
    prompt = "A different long prompt, salted: " + SECRET[:120]
    cached(front, ALICE, prompt, cache_salt="user-1")
    assert cached(front, ALICE, prompt, cache_salt="user-2") == 0
    assert cached(front, ALICE, prompt) == 0  # the tenant's own default salt is another salt
    assert cached(front, ALICE, prompt, cache_salt="user-1") >= 48
    assert cached(front, BOB, prompt, cache_salt="user-1") == 0  # a salt names no other tenant's cache
    assert cache_salt("", "") == "" and cache_salt("a", "") != cache_salt("", "a")


def test_another_tenants_media_key_answers_as_an_unknown_key(tenants):
    sched = tenants[0]
    with Client(sched.address, timeout=120, api_key=ALICE) as a, Client(sched.address, timeout=120, api_key=BOB) as b:
        sent = a.generate(f"Describe {PH}", [image(3)], **GREEDY)
        key = sent.media_keys[0]
        answers = []
        for k in (key, key[:-4] + ("0000" if not key.endswith("0000") else "1111")):  # hers, and one never seen
            with pytest.raises(EPDServeError) as e:
                b.generate(f"Describe {PH}", [MediaKey(k)], **GREEDY)
            answers.append((e.value.code, e.value.details.replace(k, "KEY")))
        assert answers[0] == answers[1] and answers[0][0] == grpc.StatusCode.INVALID_ARGUMENT
        assert "unknown media key" in answers[0][1]
        try:  # alice's own key is known to her (its features may be gone from the MM Store by then)
            a.generate(f"Again {PH}", [MediaKey(key)], **GREEDY)
        except EPDServeError as e:
            assert "unknown media key" not in e.details
        # bob's copy of the same image is keyed apart: nothing of alice's features is his
        assert b.generate(f"Describe {PH}", [image(3)], **GREEDY).media_keys[0] != key


def test_abort_and_request_ids_are_per_tenant(tenants):
    sched = tenants[0]
    with Client(sched.address, timeout=120, api_key=ALICE) as a, Client(sched.address, timeout=120, api_key=BOB) as b:
        stream = a.generate_stream("Tell a long story", request_id="job-1", max_tokens=400, ignore_eos=True)
        first = next(stream)
        wait_until(lambda: sched.call(lambda: ("alice", "job-1") in sched.server.dispatcher.runs),
                   what="alice's request to run")
        assert b.abort("job-1") is False  # hers is not found by bob, as an id never seen is not
        assert b.abort("never-seen") is False
        rest = list(stream)
        assert rest[-1].finish_reason == "length"  # her request ran to its end
        assert len(first.token_ids) + sum(len(d.token_ids) for d in rest) == 400


def test_a_tenant_past_its_quota_gets_429_and_others_are_served(tenants):
    sched, front = tenants
    wait_until(lambda: sched.call(lambda: "alice" not in sched.server.dispatcher._per_tenant),
               what="alice's earlier requests to end")
    with Client(sched.address, timeout=120, api_key=ALICE) as a:
        stream = a.generate_stream("Hold a slot", max_tokens=400, ignore_eos=True)
        next(stream)
        status, body, resp = post(front, "/v1/completions", {"prompt": "one more", **GREEDY}, ALICE)
        assert status == 429 and resp.getheader("Retry-After") == "1", body
        assert cached(front, BOB, "bob is served meanwhile") == 0
        stream.close()


def test_n_counts_against_a_tenants_sequences(tenants):
    """n choices are n sequences: n above the tenant's limit (4) is refused at once, naming it;
    n at the limit is served, every choice."""
    front = tenants[1]
    status, body, _ = post(front, "/v1/completions", {"prompt": "many", "n": 5, **GREEDY}, BOB)
    assert status == 400 and "--max-sequences-per-tenant" in body["error"]["message"], body
    status, body, _ = post(front, "/v1/completions", {"prompt": "many", "n": 4, **GREEDY}, BOB)
    assert status == 200 and len(body["choices"]) == 4, body


def test_unknown_keys_are_refused_on_both_fronts(tenants):
    sched, front = tenants
    status, _, _ = post(front, "/v1/completions", {"prompt": "hi", **GREEDY}, "sk-mallory")
    assert status == 401
    with Client(sched.address, timeout=30, api_key="sk-mallory") as c:
        with pytest.raises(EPDServeError) as e:
            c.generate("hi", **GREEDY)
        assert e.value.code == grpc.StatusCode.UNAUTHENTICATED


def test_the_keys_file_is_reloaded_on_sighup(tmp_path):
    from epdserve.entrypoints.scheduler_cli import _reload_keys_on_sighup

    if threading.current_thread() is not threading.main_thread():
        pytest.skip("signals are delivered to the main thread")
    path = tmp_path / "keys"
    path.write_text("alice sk-a1\n")
    keys = TenantKeys(file=path)
    security = type("S", (), {"tenants": keys})()
    previous = signal.getsignal(signal.SIGHUP)

    async def run():
        _reload_keys_on_sighup(security, asyncio.get_running_loop())
        path.write_text("alice sk-a2\ncarol sk-c1\n")
        os.kill(os.getpid(), signal.SIGHUP)
        while keys.tenant_of("sk-c1") is None:
            await asyncio.sleep(0.01)

    try:
        asyncio.run(asyncio.wait_for(run(), 10))
    finally:
        signal.signal(signal.SIGHUP, previous)
    assert (keys.tenant_of("sk-a1"), keys.tenant_of("sk-a2"), keys.tenant_of("sk-c1")) == (None, "alice", "carol")
    path.write_text("alice\n")  # broken: the keys in use stay
    assert keys.reload() is False and keys.tenant_of("sk-a2") == "alice"


def test_server_info_shows_a_tenant_neither_hosts_nor_paths_nor_shared_counters(tenants, qwen2_vl_tiny):
    sched, front = tenants
    cached(front, ALICE, SECRET)
    cached(front, ALICE, SECRET)  # hits: the shared counters move
    with Client(sched.address, timeout=120, api_key=ALICE) as a:
        for opening in ("Look", "See"):  # one image after two prefixes: the second a feature-cache hit
            a.generate(f"{opening}: {PH}", [image(11)], **GREEDY)
    # the roster (the insider's view) has the hit before bob looks: his zero is the field withheld
    wait_until(lambda: any(r.load.mm_cache_hit_rate > 0 for r in sched.call(lambda: list(sched.server.registry.records()))),
               what="the feature cache's hit in the roster")
    with Client(sched.address, timeout=30, api_key=BOB) as c:
        info = c.server_info()
    text = str(info)
    assert info.instances and str(qwen2_vl_tiny) not in text and socket.gethostname() not in text
    assert info.prefix_cache_hit_rate == 0 and all(i.load.prefix_hit_tokens == 0 for i in info.instances)
    assert all(i.load.mm_cache_hit_rate == 0 for i in info.instances)


def test_a_tenants_upload_flood_evicts_only_its_own_files(tenants):
    """Bob uploads past his share (three files): his own oldest go, never alice's, whose file still
    answers in chat; his file larger than the share is a 429 naming the limit."""
    sched, front = tenants
    base = f"http://{front.address}/v1"
    with openai.OpenAI(base_url=base, api_key=ALICE, max_retries=0, timeout=120) as a, \
            openai.OpenAI(base_url=base, api_key=BOB, max_retries=0, timeout=120) as b:
        hers = a.files.create(file=("a.jpg", image(21), "image/jpeg"), purpose="vision")
        his = [b.files.create(file=(f"b{k}.jpg", image(30 + k), "image/jpeg"), purpose="vision") for k in range(6)]
        for gone in his[:3]:
            with pytest.raises(openai.NotFoundError):
                b.files.retrieve(gone.id)
        assert [b.files.retrieve(f.id).id for f in his[3:]] == [f.id for f in his[3:]]
        with pytest.raises(openai.RateLimitError) as e:
            b.files.create(file=("big.jpg", image(40, 448, 448), "image/jpeg"), purpose="vision")
        assert "--upload-tenant-max-bytes" in str(e.value)
        assert a.files.retrieve(hers.id).id == hers.id
    chat = {"messages": [{"role": "user", "content": [{"type": "text", "text": "What is it?"},
                                                      {"type": "file", "file": {"file_id": hers.id}}]}], **GREEDY}
    status, body, _ = post(front, "/v1/chat/completions", chat, ALICE)
    assert status == 200 and body["usage"]["prompt_tokens"] > 10, body
