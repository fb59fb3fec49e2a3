"""Fair share between tenants in one engine (engine/fair_share.py): when the engine is full, the
next admission goes to the tenant holding the least weighted share of the running sequences (n
counts n); a preemption takes the newest request of the tenant holding the most; one tenant alone
is served in queue order. Orders are read from the engine's own outputs, never from a clock."""
import pytest

from epdserve.engine.config import EngineConfig
from epdserve.engine.engine_request import EngineRequest
from epdserve.engine.fair_share import next_admission, preemption_victim
from epdserve.engine.llm_engine import LLMEngine
from epdserve.engine.request_parts import TenantShare
from epdserve.engine.sampling_params import SamplingParams
from epdserve.engine.sequence import Sequence

A, B = TenantShare("alice"), TenantShare("bob")


def _seq(rid, tenant, arrival, n=1):
    return Sequence(rid, [1, 2, 3], SamplingParams(n=n), tenant=tenant, arrival=arrival)


def _ready(_):
    return True


NEVER: dict[str, int] = {}


def test_the_least_served_tenant_goes_first_and_queue_order_within_a_tenant():
    running = [_seq("b0", B, 0), _seq("b1", B, 1)]
    waiting = [_seq("b2", B, 2), _seq("b3", B, 3), _seq("a0", A, 4), _seq("a1", A, 5)]
    assert next_admission(waiting, running, _ready, NEVER).request_id == "a0"
    # a group counts its n: bob's one request of n = 4 outweighs alice's three
    running = [_seq("b0", B, 0, n=4), _seq("a0", A, 1), _seq("a1", A, 2), _seq("a2", A, 3)]
    assert next_admission([_seq("a3", A, 4), _seq("b1", B, 5)], running, _ready, NEVER).request_id == "b1"
    # a request that may not run (its grammar compiling) is passed over, the next of its tenant taken
    assert next_admission(waiting, running[:1], lambda s: s.request_id != "a0", NEVER).request_id == "a1"


def test_between_equal_shares_the_tenant_admitted_least_recently_goes_first():
    waiting = [_seq("b2", B, 2), _seq("a0", A, 4)]
    assert next_admission(waiting, [], _ready, {"bob": 7}).request_id == "a0"
    assert next_admission(waiting, [], _ready, {"bob": 7, "alice": 9}).request_id == "b2"


def test_one_tenant_alone_is_served_in_queue_order():
    waiting = [_seq(f"r{i}", TenantShare(), i) for i in (3, 1, 2)]
    assert next_admission(waiting, [_seq("x", TenantShare(), 0)], _ready, NEVER) is waiting[0]


def test_weights_scale_the_share():
    heavy = TenantShare("bob", weight=4.0)
    running = [_seq("b0", heavy, 0), _seq("b1", heavy, 1), _seq("a0", A, 2)]
    # bob runs 2 at weight 4 (0.5), alice 1 at weight 1 (1.0): bob's next goes first
    assert next_admission([_seq("a1", A, 3), _seq("b2", heavy, 4)], running, _ready, NEVER).request_id == "b2"


def test_a_preemption_takes_the_newest_request_of_the_greediest_tenant():
    running = [_seq("a0", A, 0), _seq("b0", B, 1), _seq("b1", B, 2), _seq("a1", A, 3)]
    assert preemption_victim(running, exclude=running[0]).request_id == "b1"
    alone = [_seq(f"r{i}", TenantShare(), i) for i in range(3)]
    assert preemption_victim(alone, exclude=alone[2]).request_id == "r1"


@pytest.mark.parametrize("policy", ["fair", "fcfs"])
def test_an_engine_full_of_one_tenant_admits_the_other_as_slots_free(qwen2_vl_tiny, policy):
    """Bob's six requests fill both slots and queue; alice's two arrive after them: each of hers is
    admitted at the next free slot, ahead of bob's queued ones; every request completes. With
    `--scheduling-policy fcfs` hers wait behind all of his."""
    eng = LLMEngine(EngineConfig(model=str(qwen2_vl_tiny), device="cpu", max_num_seqs=2, kv_cache_bytes=32 << 20,
                                 scheduling_policy=policy))
    params = SamplingParams(max_tokens=4, ignore_eos=True)

    def add(rid, tenant):
        eng.add_request(EngineRequest(rid, [5 + len(rid) + int(rid[1:]), 7, 11, 13], params=params, tenant=tenant))

    for i in range(6):
        add(f"b{i}", B)
    first: list[str] = []
    done: set[str] = set()
    for n in range(500):
        if n == 1:  # b0 and b1 run; bob's four others wait
            add("a0", A)
            add("a1", A)
        if n > 1 and not eng.has_unfinished():
            break
        for o in eng.step():
            first += [o.request_id] if o.request_id not in first else []
            if o.finished:
                done.add(o.request_id)
    assert done == {"a0", "a1"} | {f"b{i}" for i in range(6)}
    # b0 and b1 end together: alice (never admitted) takes a slot, bob the other; then alike
    fair = ["b0", "b1", "a0", "b2", "a1", "b3", "b4", "b5"]
    assert first == (fair if policy == "fair" else [f"b{i}" for i in range(6)] + ["a0", "a1"]), first
