"""Fair share between tenants in one engine (engine/fair_share.py): when the engine is full, the
next admission goes to the tenant holding the least weighted share of the running sequences (n
counts n); a preemption takes the newest request of the tenant holding the most; one tenant alone
is served in queue order. Orders are read from the engine's own outputs, never from a clock."""
import pytest

from epdserve.engine.config import EngineConfig
from epdserve.engine.engine_request import EngineRequest
from epdserve.engine.fair_share import fairness_victims, next_admission, preemption_victim
from epdserve.engine.llm_engine import LLMEngine
from epdserve.engine.request_parts import ChoiceGroup, TenantShare
from epdserve.engine.sampling_params import SamplingParams
from epdserve.engine.sequence import Sequence

A, B = TenantShare("alice"), TenantShare("bob")


def _seq(rid, tenant, arrival, n=1):
    """A request of n choices not forked yet (it counts n, as the engine's does)."""
    group = ChoiceGroup(n, [None] * (n - 1)) if n > 1 else None
    return Sequence(rid, [1, 2, 3], SamplingParams(n=n), tenant=tenant, arrival=arrival, group=group)


def _ready(_):
    return True


NEVER: dict[str, int] = {}


def test_the_least_served_tenant_goes_first_and_queue_order_within_a_tenant():
    running = [_seq("b0", B, 0), _seq("b1", B, 1)]
    waiting = [_seq("b2", B, 2), _seq("b3", B, 3), _seq("a0", A, 4), _seq("a1", A, 5)]
    assert next_admission(waiting, running, _ready, NEVER).request_id == "a0"
    # a group counts its n: bob's one request of n = 4 outweighs alice's three (counted as one, bob's
    # next would go first)
    running = [_seq("b0", B, 0, n=4), _seq("a0", A, 1), _seq("a1", A, 2), _seq("a2", A, 3)]
    assert next_admission([_seq("a3", A, 4), _seq("b1", B, 5)], running, _ready, NEVER).request_id == "a3"
    # a request that may not run (its grammar compiling) is passed over, the next of its tenant taken
    assert next_admission(waiting, running[:1], lambda s: s.request_id != "a0", NEVER).request_id == "a1"


def test_between_equal_shares_the_tenant_admitted_least_recently_goes_first():
    waiting = [_seq("b2", B, 2), _seq("a0", A, 4)]
    assert next_admission(waiting, [], _ready, {"bob": 7}).request_id == "a0"
    assert next_admission(waiting, [], _ready, {"bob": 7, "alice": 9}).request_id == "b2"


def test_a_newcomer_displaces_the_greediest_tenants_newest_sequences_only_while_that_evens_the_shares():
    running = [_seq(f"b{i}", B, i) for i in range(4)] + [_seq("c0", TenantShare("carol"), 9)]
    newcomer = _seq("a0", A, 10)
    assert [v.request_id for v in fairness_victims(newcomer, running, 1, _ready)] == ["b3"]
    # room for two: bob 4 -> 2 with alice at 1; for three, bob would fall to alice's level: nobody moves
    assert [v.request_id for v in fairness_victims(newcomer, running, 2, _ready)] == ["b3", "b2"]
    assert fairness_victims(newcomer, running, 3, _ready) == []
    assert fairness_victims(_seq("b9", B, 11), running, 1, _ready) == []  # never its own tenant's
    # a group of n = 4 would hold more than bob keeps: nobody moves for it
    assert fairness_victims(_seq("a1", A, 12, n=4), running, 1, _ready) == []
    # only what may be displaced (decoding, say): bob's newest that may
    assert [v.request_id for v in fairness_victims(newcomer, running, 1, lambda s: s.request_id != "b3")] == ["b2"]


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
    assert eng.scheduler.num_fair_preemptions == 0  # two slots, bob holding both: alice at one would be even


def _four_of_bob_then_alice(model, policy):
    eng = LLMEngine(EngineConfig(model=str(model), device="cpu", max_num_seqs=4, kv_cache_bytes=32 << 20,
                                 scheduling_policy=policy))
    params = SamplingParams(max_tokens=10, ignore_eos=True)
    for i in range(4):
        eng.add_request(EngineRequest(f"b{i}", [9 + i, 7, 11, 13, 17], params=params, tenant=B))
    outs: dict[str, list] = {}
    events: list = []  # every output, in the order the engine gave them
    for n in range(500):
        if n == 2:  # bob's four decode, the engine is full
            assert len(eng.scheduler.decoding()) == 4
            for j in range(2):
                eng.add_request(EngineRequest(f"a{j}", [21 + j, 7, 11, 13, 17], params=params, tenant=A))
        if n > 2 and not eng.has_unfinished():
            break
        for o in eng.step():
            outs.setdefault(o.request_id, []).append(o)
            events.append(o)
    return eng, outs, events


def test_a_full_engine_displaces_a_flooding_tenants_newest_sequence_and_loses_nothing(qwen2_vl_tiny):
    """Bob holds all four slots; alice's first request displaces bob's newest decoding sequence (4 -> 3
    against 0 -> 1; her second would not even it further) and streams before any of bob's ends; the
    displaced one is recomputed and its tokens equal a run without displacement."""
    eng, outs, events = _four_of_bob_then_alice(qwen2_vl_tiny, "fair")
    ref, ref_outs, _ = _four_of_bob_then_alice(qwen2_vl_tiny, "fcfs")
    assert eng.scheduler.num_fair_preemptions == 1 and ref.scheduler.num_fair_preemptions == 0
    first_a0 = next(i for i, o in enumerate(events) if o.request_id == "a0")
    first_end = next(i for i, o in enumerate(events) if o.finished)
    assert first_a0 < first_end
    for rid in ("b0", "b1", "b2", "b3", "a0", "a1"):
        assert outs[rid][-1].finished and list(outs[rid][-1].token_ids) == list(ref_outs[rid][-1].token_ids), rid

