"""The `slo` policy's core lease (instance/lease_arbiter.py, instance/core_lease.py), over a real
Unix socket: the grant order, yield requests, decode pacing, a dead holder, a dead arbiter."""
from __future__ import annotations

import subprocess
import sys
import threading
import time

import pytest

from epdserve.instance.core_lease import Checkpoints, CoreLease, LeaseGate
from epdserve.instance.lease_arbiter import LeaseArbiter, _Waiter, choose, should_yield


@pytest.fixture
def arbiter():
    a = LeaseArbiter().start()
    yield a
    a.close()


def _until(pred, timeout_s=10.0):
    deadline = time.monotonic() + timeout_s
    while not pred():
        if time.monotonic() > deadline:
            raise AssertionError("condition not met in time")
        time.sleep(0.005)


def test_grant_order_and_who_yields():
    now = 100.0
    w = {"e": _Waiter(b"E", 0.0, 0), "p": _Waiter(b"P", 0.0, 1), "d_later": _Waiter(b"D", 150.0, 2),
         "d_due": _Waiter(b"D", 99.0, 3)}
    assert choose(w, now) == "d_due"
    del w["d_due"]
    assert choose(w, now) == "p"
    del w["p"]
    assert choose(w, now) == "e"
    del w["e"]
    assert choose(w, now) == "d_later"  # nobody else waits: a decode step not yet due runs at once
    assert choose({}, now) is None
    assert should_yield(b"E", {"p": _Waiter(b"P", 0, 0)}, now)
    assert not should_yield(b"P", {"e": _Waiter(b"E", 0, 0)}, now)
    assert not should_yield(b"P", {"d": _Waiter(b"D", 101.0, 0)}, now)
    assert should_yield(b"P", {"d": _Waiter(b"D", 99.0, 0)}, now)
    assert not should_yield(b"D", {"d": _Waiter(b"D", 0.0, 0), "p": _Waiter(b"P", 0, 1)}, now)


def _acquire_in_thread(lease, kind, due=0.0):
    got = threading.Event()

    def run():
        lease.acquire(kind, due)
        got.set()

    threading.Thread(target=run, daemon=True).start()
    return got


def test_encode_gives_way_to_prefill_then_gets_the_cores_back(arbiter):
    e, p = CoreLease(arbiter.path, "E"), CoreLease(arbiter.path, "P")
    e.acquire("E")
    assert not e.yield_requested()
    got = _acquire_in_thread(p, "P")
    _until(e.yield_requested)
    assert not got.is_set()  # one holder at a time: P waits for E's checkpoint
    back = _acquire_in_thread(e, "E") if (e.release() or True) else None
    got.wait(10)
    assert got.is_set() and not back.is_set()
    p.release()
    assert back.wait(10)
    assert arbiter.grants[b"E"] == 2 and arbiter.grants[b"P"] == 1 and arbiter.yields_asked == 1


def test_a_decode_step_waits_for_its_due_time_only_while_others_work(arbiter):
    e, d = CoreLease(arbiter.path, "E"), CoreLease(arbiter.path, "D")
    d.acquire("D", time.monotonic() + 60.0)  # nobody else waits: granted though not due
    d.release()
    e.acquire("E")
    due = time.monotonic() + 0.3
    got = _acquire_in_thread(d, "D", due)
    time.sleep(0.05)
    assert not e.yield_requested()  # not due yet: encode keeps the cores
    _until(e.yield_requested)
    assert time.monotonic() >= due
    e.release()
    assert got.wait(10)
    d.release()


def test_the_gate_paces_decode_at_a_share_of_the_tpot_slo(arbiter):
    gate = LeaseGate(CoreLease(arbiter.path, "D"), Checkpoints(), tpot_slo_s=0.1)
    assert gate.decode_due() == 0.0
    with gate.hold("D"):
        time.sleep(0.02)
    due = gate.decode_due()
    assert 0.0 < due - gate._last_decode_end <= gate.pace_s
    assert gate.pace_s == pytest.approx(0.07)


def test_checkpoints_hand_the_cores_over_on_the_holders_thread(arbiter):
    cp = Checkpoints()
    e_gate = LeaseGate(CoreLease(arbiter.path, "E"), cp, tpot_slo_s=0.1)
    p = CoreLease(arbiter.path, "P")
    order = []
    with e_gate.hold("E"):
        got = _acquire_in_thread(p, "P")
        _until(lambda: arbiter.yields_asked == 1)

        def prefill():  # P computes once granted, then gives the cores back
            got.wait(10)
            order.append("P ran")
            p.release()

        threading.Thread(target=prefill, daemon=True).start()
        cp.poll()  # a layer boundary on the encode thread: yields, then waits for the cores again
        order.append("E resumed")
    assert e_gate.yields == 1 and order == ["P ran", "E resumed"]
    cp.poll()  # no holder on this thread now: nothing happens
    assert e_gate.yields == 1


def test_a_holder_that_dies_releases_the_cores(arbiter):
    code = ("import sys, time; from epdserve.instance.core_lease import CoreLease; "
            "l = CoreLease(sys.argv[1]); l.acquire('P'); print('held', flush=True); time.sleep(60)")
    child = subprocess.Popen([sys.executable, "-c", code, arbiter.path], stdout=subprocess.PIPE, text=True)
    try:
        assert child.stdout.readline().strip() == "held"
        e = CoreLease(arbiter.path, "E")
        got = _acquire_in_thread(e, "E")
        time.sleep(0.1)
        assert not got.is_set()
        child.kill()
        assert got.wait(10)
    finally:
        child.kill()
        child.wait()


def test_without_the_arbiter_a_worker_computes_unarbitrated():
    a = LeaseArbiter().start()
    lease = CoreLease(a.path, "P")
    a.close()
    lease.acquire("P")  # returns: the lease is broken, not a hang
    assert lease.broken and not lease.yield_requested()
    lease.release()
