"""Fair share across tenants, end to end (issue 51 item 1): a real scheduler with a keys file
(alice, bob, carol with weight 3) and a real EPD instance host running two sequences at most. Bob
floods: his requests fill both slots and queue on the instance; alice's requests, sent after his,
are admitted as the next slots free, ahead of his queued ones, and nothing of his is lost. The
order is read from the instance (the tenant each admission went to) and from which streams
ended first, never from a clock."""
from __future__ import annotations

import threading

import pytest

from epdserve import Client
from epdserve.instance.config import InstanceConfig
from epdserve.instance.host import InstanceHost
from epdserve.scheduler import SchedulerConfig, SchedulerThread
from epdserve.security.options import SchedulerSecurity
from tests.instance.harness import wait_until

ALICE, BOB, CAROL = "sk-alice-f41a", "sk-bob-9d0c", "sk-carol-33e7"


@pytest.fixture(autouse=True)
def _no_env_secrets(no_env_secrets):
    """Every test here runs without credentials from the environment (conftest.py)."""


@pytest.fixture(scope="module")
def deployment(qwen2_vl_tiny, tmp_path_factory):
    keys = tmp_path_factory.mktemp("keys") / "keys"
    keys.write_text(f"alice {ALICE}\nbob {BOB}\ncarol {CAROL}\n@weight carol 3\n")
    security = SchedulerSecurity(api_keys_file=str(keys))
    sched = SchedulerThread(SchedulerConfig(model=str(qwen2_vl_tiny), probe_interval_s=0.2), security=security)
    sched.start()
    host = InstanceHost(InstanceConfig(roles="EPD", model=str(qwen2_vl_tiny), scheduler=sched.server.internal_address,
                                       kv_cache_bytes=8 << 20, max_num_seqs=2)).start()
    try:
        assert host.wait_registered(30)
        wait_until(lambda: sched.call(sched.server.registry.records), what="the instance to register")
        yield sched, host
    finally:
        host.stop()
        sched.stop()


def _engine(host):
    return host.worker("PD").engine


def test_a_flooding_tenant_does_not_keep_another_out(deployment):
    sched, host = deployment
    sched_engine = _engine(host).scheduler
    ended: list[str] = []
    lock = threading.Lock()
    errors: list[BaseException] = []

    def run(key, name, max_tokens):
        try:
            with Client(sched.address, timeout=120, api_key=key) as c:
                out = c.generate(f"request {name} asks for a few tokens", max_tokens=max_tokens, ignore_eos=True)
            assert len(out.token_ids) == max_tokens
            with lock:
                ended.append(name)
        except BaseException as e:  # noqa: BLE001 - re-raised below, in the test's thread
            errors.append(e)

    bobs = [threading.Thread(target=run, args=(BOB, f"b{i}", 48)) for i in range(6)]
    for t in bobs:
        t.start()
    # bob holds both slots and at least two of his wait on the instance
    wait_until(lambda: len(sched_engine.running) == 2 and len(sched_engine.waiting) >= 2,
               what="bob's requests to fill the instance and queue")
    queued = len(sched_engine.waiting)
    alices = [threading.Thread(target=run, args=(ALICE, f"a{i}", 4)) for i in range(2)]
    for t in alices:
        t.start()
    for t in bobs + alices:
        t.join(180)
    assert not errors, errors
    assert sorted(ended) == ["a0", "a1"] + [f"b{i}" for i in range(6)]  # nothing lost
    # alice's are admitted as slots free, ahead of bob's queued ones, which all end after hers; in
    # arrival order (fcfs) hers would end after every one of them
    last_alice = max(ended.index("a0"), ended.index("a1"))
    assert len(ended) - 1 - last_alice >= queued, (ended, queued)


def test_the_tenant_and_its_weight_reach_the_engine(deployment):
    sched, host = deployment
    seen = []
    eng = _engine(host)
    original = eng.add_request

    def spy(req):
        seen.append(req.tenant)
        return original(req)

    eng.add_request = spy
    try:
        for key in (CAROL, ALICE):
            with Client(sched.address, timeout=120, api_key=key) as c:
                c.generate("who asks", max_tokens=1)
    finally:
        eng.add_request = original
    assert [(t.name, t.weight) for t in seen] == [("carol", 3.0), ("alice", 1.0)]


def test_weights_come_from_the_keys_file_and_a_bad_weight_line_is_refused(tmp_path):
    from epdserve.security.tenants import KeysFileError, TenantKeys

    path = tmp_path / "keys"
    path.write_text("alice sk-a\nbob sk-b\n@weight bob 2.5\n")
    keys = TenantKeys(file=path)
    assert (keys.weight("alice"), keys.weight("bob"), keys.tenant_of("sk-b")) == (1.0, 2.5, "bob")
    for bad in ("@weight bob 0", "@weight bob -1", "@weight bob lots", "@weight bob", "@weight mallory 2",
                "@weight bob inf", "@weight bob nan"):
        path.write_text(f"alice sk-a\nbob sk-b\n{bad}\n")
        with pytest.raises(KeysFileError) as e:
            TenantKeys(file=path)
        assert "sk-" not in str(e.value)  # never a key in the message
    path.write_text("alice sk-a\nbob sk-b\n@weight bob 4\n")
    assert keys.reload() and keys.weight("bob") == 4.0


def test_a_tenants_big_schemas_do_not_hold_up_anothers_small_one(deployment):
    """Bob sends three requests with big new schemas; their compiles are held (the engine's compile
    hook, on the real instance); alice's small new schema compiles and she is answered meanwhile;
    released, bob's are served too; the compiled-grammar cache stays within its bound."""
    import json

    sched, host = deployment
    eng = _engine(host)
    held, entered = threading.Event(), threading.Event()

    def hold_big(c):
        if "bob-big" in c.spec:
            entered.set()
            assert held.wait(120), "the test never released bob's compiles"

    eng.grammar_compiles.before_compile = hold_big
    results: dict[str, object] = {}

    def ask(key, name, schema):
        try:
            with Client(sched.address, timeout=120, api_key=key) as c:
                results[name] = c.generate(f"{name} asks", max_tokens=30, structured={"json": schema})
        except BaseException as e:  # noqa: BLE001 - asserted below
            results[name] = e

    big = [{"type": "object", "properties": {"k": {"enum": [f"bob-big-{i}-{j}" for j in range(800)]}},
            "required": ["k"]} for i in range(3)]
    small = {"type": "object", "properties": {"ok": {"enum": ["yes", "no"]}}, "required": ["ok"]}
    try:
        bobs = [threading.Thread(target=ask, args=(BOB, f"bob{i}", s)) for i, s in enumerate(big)]
        for t in bobs:
            t.start()
        assert entered.wait(60), "bob's first compile never started"
        ask(ALICE, "alice", small)  # served while bob's compiles are held
        assert json.loads(results["alice"].text)["ok"] in ("yes", "no")
        assert not any(f"bob{i}" in results for i in range(3))
    finally:
        held.set()
        for t in bobs:
            t.join(120)
        eng.grammar_compiles.before_compile = None
    assert all(not isinstance(results[f"bob{i}"], BaseException) for i in range(3)), results
    assert eng.grammars.cache_bytes <= eng.config.grammar_cache_bytes
