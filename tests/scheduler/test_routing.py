"""Router: coupled vs. P+D, media spread across E, least outstanding work, the id cursor,
backpressure (RESOURCE_EXHAUSTED) and missing roles (UNAVAILABLE)."""
import grpc
import pytest

from epdserve.rpc import common_pb2
from epdserve.scheduler.errors import RequestError
from epdserve.scheduler.registry import InstanceRegistry
from epdserve.scheduler.routing import Cursor, Router


def reg_with(*specs):
    reg = InstanceRegistry()
    for iid, roles in specs:
        reg.register(common_pb2.InstanceStatus(instance_id=iid, roles=roles, address=f"h:{iid}"))
    return reg


def test_text_only_disaggregated_skips_e_and_balances_p_and_d():
    reg = reg_with(("e0", "E"), ("p0", "P"), ("p1", "P"), ("d0", "D"), ("d1", "D"))
    router = Router(reg)
    plan1, lease1 = router.plan(100, 16, [], [])
    assert plan1.coupled is None and plan1.encodes == []
    plan2, lease2 = router.plan(10, 16, [], [])
    assert {plan1.prefill.instance_id, plan2.prefill.instance_id} == {"p0", "p1"}
    assert {plan1.decode.instance_id, plan2.decode.instance_id} == {"d0", "d1"}
    lease2.done("P")  # plan2's P finished prefill; plan1's P still has 100 tokens outstanding
    plan3, _ = router.plan(5, 16, [], [])
    assert plan3.prefill.instance_id == plan2.prefill.instance_id
    lease1.release()
    lease1.release()  # idempotent
    assert reg.get(plan1.prefill.instance_id).outstanding["P"] == 0
    assert reg.get(plan1.prefill.instance_id).inflight == 0


def test_media_spread_across_encoders_by_tokens():
    reg = reg_with(("e0", "E"), ("e1", "E"), ("p0", "P"), ("d0", "D"))
    plan, _ = Router(reg).plan(50, 8, [40, 10, 10, 10], [0, 1, 2, 3])
    by_e = {rec.instance_id: items for rec, items in plan.encodes}
    assert sorted(i for items in by_e.values() for i in items) == [0, 1, 2, 3]
    loads = sorted(sum([40, 10, 10, 10][i] for i in items) for items in by_e.values())
    assert loads == [30, 40]  # the big image alone on one encoder, the three small ones on the other
    assert plan.target.instance_id == "p0"


def test_coupled_instances_take_whole_requests_epd_encodes_inline():
    reg = reg_with(("c0", "EPD"), ("c1", "EPD"))
    plan, _ = Router(reg).plan(10, 8, [4], [0])
    assert plan.coupled is not None and plan.encodes == [] and plan.prefill is None
    reg = reg_with(("e0", "E"), ("c0", "PD"))
    plan, _ = Router(reg).plan(10, 8, [4], [0])
    assert plan.coupled.instance_id == "c0" and [r.instance_id for r, _ in plan.encodes] == ["e0"]


def test_p_plus_e_prefills_with_inline_encoding_and_is_never_an_encoder():
    reg = reg_with(("p0", "P+E"), ("d0", "D"))
    assert [r.instance_id for r in reg.candidates("P")] == ["p0"] and reg.candidates("E") == []
    plan, _ = Router(reg).plan(10, 8, [4, 4], [0, 1])
    assert plan.coupled is None and plan.prefill.instance_id == "p0" and plan.decode.instance_id == "d0"
    assert plan.encodes == []  # P+E encodes its own requests' media
    reg = reg_with(("e0", "E"), ("p0", "P"), ("d0", "D"))  # a plain P still gets its media from E
    assert [r.instance_id for r, _ in Router(reg).plan(10, 8, [4], [0])[0].encodes] == ["e0"]


def test_cursor_round_robins_ties_and_survives_roster_changes():
    reg = reg_with(("c0", "EPD"), ("c1", "EPD"), ("c2", "EPD"))
    router = Router(reg)
    picks = []
    for _ in range(4):
        plan, lease = router.plan(1, 1, [], [])
        picks.append(plan.coupled.instance_id)
        lease.release()
    assert picks == ["c0", "c1", "c2", "c0"]
    reg.deregister("c1")  # the cursor is at c0: the next is c2, not "index 1"
    reg.register(common_pb2.InstanceStatus(instance_id="c3", roles="EPD", address="h:c3"))
    picks = []
    for _ in range(3):
        plan, lease = router.plan(1, 1, [], [])
        picks.append(plan.coupled.instance_id)
        lease.release()
    assert picks == ["c2", "c3", "c0"]
    c = Cursor()
    assert c.choose(reg.records()).instance_id == "c0"


def test_backpressure_and_missing_roles():
    reg = reg_with(("p0", "P"), ("d0", "D"))
    router = Router(reg, max_inflight_per_instance=1)
    router.plan(1, 1, [], [])
    with pytest.raises(RequestError) as e:
        router.plan(1, 1, [], [])
    assert e.value.code == grpc.StatusCode.RESOURCE_EXHAUSTED
    with pytest.raises(RequestError) as e:
        Router(reg_with(("p0", "P"))).plan(1, 1, [], [])
    assert e.value.code == grpc.StatusCode.UNAVAILABLE and "decode" in e.value.message
    with pytest.raises(RequestError) as e:
        Router(InstanceRegistry()).plan(1, 1, [], [])
    assert e.value.code == grpc.StatusCode.UNAVAILABLE


def test_avoid_prefers_other_instances_but_falls_back():
    reg = reg_with(("c0", "EPD"), ("c1", "EPD"))
    router = Router(reg)
    for _ in range(3):
        plan, lease = router.plan(1, 1, [], [], avoid={"c0"})
        assert plan.coupled.instance_id == "c1"
        lease.release()
    plan, _ = Router(reg_with(("c0", "EPD"))).plan(1, 1, [], [], avoid={"c0"})
    assert plan.coupled.instance_id == "c0"


def test_work_counts_per_device_of_an_instance_s_degree():
    """A D at TP4 and a D at TP1: least outstanding work per device, so the TP4 one keeps taking
    requests until it holds about four times the other's work."""
    reg = InstanceRegistry()
    for iid, roles, degree in (("p0", "P", 1), ("d1", "D", 1), ("d4", "D", 4)):
        layout = common_pb2.KvLayout(degree=degree, num_layers=2, num_kv_heads=4, head_dim=8, block_size=16,
                                     dtype="float32")
        reg.register(common_pb2.InstanceStatus(instance_id=iid, roles=roles, address=f"h:{iid}", kv_layout=layout))
    router = Router(reg)
    picks = [router.plan(10, 100, [], [])[0].decode.instance_id for _ in range(10)]
    assert picks.count("d4") == 8 and picks.count("d1") == 2, picks
    assert reg.get("d4").degree == 4 and reg.get("p0").degree == 1
