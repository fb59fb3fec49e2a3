"""Live role switching (instance/role_switch.py, `SwitchRoles`): real instance hosts registered
with a real scheduler, a real MM Store and gloo KV pairs. An instance switches while requests are
in flight on it; they finish there (no retry, outputs equal transformers'), the instance comes back
under a new id with its new roles, on the model it already held (no reload), and serves the next
requests in them. Overlapped (`--switch-overlap`, on by default on CPU) the new roles serve while the
old ones drain beside them; drained first (off), a lone instance switching leaves a gap: requests
wait it out, none fails."""
from __future__ import annotations

import logging
import threading
from concurrent.futures import ThreadPoolExecutor

import grpc
import pytest

from epdserve.client import Client
from epdserve.instance.config import InstanceConfig
from epdserve.instance.host import InstanceHost
from epdserve.model.reference import ReferenceGenerator
from epdserve.rpc import instance_pb2
from epdserve.scheduler import SchedulerConfig, SchedulerThread
from epdserve.transfer.mm_store.server import LocalRedisServer
from tests.instance.harness import PH, image, stub, wait_until
from tests.instance.test_registration import roster

MAX_TOKENS = 24


@pytest.fixture(scope="module")
def redis():
    with LocalRedisServer() as server:
        yield server


@pytest.fixture(scope="module")
def ref(qwen2_vl_tiny):
    return ReferenceGenerator(qwen2_vl_tiny)


def _work(n: int, seed: int) -> list[tuple[str, list[bytes]]]:
    out = []
    for i in range(n):
        k = i % 3
        text = f"Request {seed + i}: " + " and ".join(PH for _ in range(k)) + (" describe." if k else " say hi.")
        out.append((text, [image(100 + 10 * (seed + i) + j, 56 + 28 * (j % 2), 56) for j in range(k)]))
    return out


@pytest.fixture
def sched(qwen2_vl_tiny):
    s = SchedulerThread(SchedulerConfig(model=str(qwen2_vl_tiny), heartbeat_interval_s=0.2, probe_interval_s=0.2))
    s.start()
    yield s
    s.stop()


@pytest.fixture
def start(qwen2_vl_tiny, sched, redis):
    """start(roles): an instance host registered with `sched`; all are stopped (before it) at teardown."""
    hosts = []

    def make(roles, overlap="auto"):
        hosts.append(InstanceHost(InstanceConfig(roles=roles, model=str(qwen2_vl_tiny), scheduler=sched.server.internal_address,
                                                 mm_store=redis.url, kv_cache_bytes=4 << 20, feature_wait_s=5.0,
                                                 switch_overlap=overlap)).start())
        return hosts[-1]

    yield make
    for h in hosts:
        h.stop()


def _run(client, work, max_tokens=MAX_TOKENS):
    with ThreadPoolExecutor(len(work)) as pool:
        return list(pool.map(lambda w: client.generate(w[0], images=w[1], max_tokens=max_tokens, ignore_eos=True),
                             work))


def _retries(caplog):
    return [r.getMessage() for r in caplog.records if "attempt" in r.getMessage() and "failed" in r.getMessage()]


def _switch(host, roles, reason="test"):
    return stub(f"127.0.0.1:{host.port}").SwitchRoles(
        instance_pb2.SwitchRolesRequest(roles=roles, drain_timeout_s=60, reason=reason), timeout=120)


@pytest.mark.parametrize("overlap", ["on", "off"])
def test_switch_with_requests_in_flight_loses_nothing(sched, start, ref, caplog, overlap):
    caplog.set_level(logging.INFO)
    a, d = start("EP", overlap), start("D")
    wait_until(lambda: {a.instance_id, d.instance_id} <= set(roster(sched)), what="registration")
    model_before, old_id = a.model, a.instance_id
    first, second = _work(6, 0), _work(6, 50)
    refs = [ref.generate(p, imgs, max_tokens=MAX_TOKENS) for p, imgs in first + second]
    with Client(sched.address, timeout=300) as c:
        results: dict = {}
        t = threading.Thread(target=lambda: results.update(first=_run(c, first)))
        t.start()
        wait_until(lambda: any(w.handles for w in a.workers) or any(w.handles for w in d.workers),
                   timeout_s=60, what="requests in flight")
        resp = _switch(a, "PD", "prefill and decode here")
        t.join(300)
        assert resp.previous_instance_id == old_id and resp.instance.roles == "PD"
        assert resp.instance.instance_id == a.instance_id != old_id and not resp.instance.draining
        assert a.model is model_before  # the model it held: no reload
        assert [w.role for w in a.workers] == ["PD"] and a.workers[0].engine.model is model_before
        assert not a.retiring  # the old workers are stopped when the switch answers
        info = roster(sched)
        assert old_id not in info and info[a.instance_id].roles == "PD"
        results["second"] = _run(c, second)  # now coupled on the switched instance
    outs = results["first"] + results["second"]
    assert [list(o.token_ids) for o in outs] == refs
    assert not _retries(caplog)
    assert a.workers[0].load.counts.engine_steps > 0  # the second wave ran on the switched instance


def test_a_lone_instance_switching_makes_requests_wait_not_fail(sched, start, ref, caplog):
    caplog.set_level(logging.INFO)
    a = start("EPD", "off")
    wait_until(lambda: a.instance_id in roster(sched), what="registration")
    work = _work(4, 100)
    refs = [ref.generate(p, imgs, max_tokens=MAX_TOKENS) for p, imgs in work]
    with Client(sched.address, timeout=300) as c:
        a.draining = True  # what SwitchRoles announces first: the roster's only instance takes nothing new
        a.announce()
        wait_until(lambda: roster(sched)[a.instance_id].draining, what="draining on the roster")
        results: dict = {}
        t = threading.Thread(target=lambda: results.update(outs=_run(c, work)))
        t.start()
        wait_until(lambda: c.server_info().requests_in_flight == len(work),
                   what="the requests at the scheduler, with no routable instance")
        a.draining = False
        resp = _switch(a, "PD", "lone instance")  # the requests above wait for it
        t.join(300)
    assert resp.instance.roles == "PD"
    assert [list(o.token_ids) for o in results["outs"]] == refs
    assert not _retries(caplog)


def test_bad_switches_are_refused(qwen2_vl_tiny):
    host = InstanceHost(InstanceConfig(roles="PD", model=str(qwen2_vl_tiny), kv_cache_bytes=2 << 20)).start()
    try:
        with pytest.raises(grpc.RpcError) as e:
            _switch(host, "XYZ")
        assert e.value.code() == grpc.StatusCode.FAILED_PRECONDITION and "roles" in e.value.details()
        assert host.switch_lock.acquire(blocking=False)  # one at a time: a second switch meanwhile is refused
        try:
            with pytest.raises(grpc.RpcError) as e:
                _switch(host, "EPD")
            assert "already switching" in e.value.details()
        finally:
            host.switch_lock.release()
        assert host.roles == "PD"
    finally:
        host.stop()


def test_merge_and_split_a_p_d_pair_under_load(sched, start, ref, caplog):
    """The controller's coupling moves, done by hand: P+E -> EPD with requests in flight (the D
    parks: the next wave never reaches it), then EPD -> P+E with requests in flight on the coupled
    engine (they finish there; the parked D decodes again, over a KV pair the new P+E opens).
    Nothing retried, every output equal to transformers'."""
    caplog.set_level(logging.INFO)
    p, d = start("P+E"), start("D")
    wait_until(lambda: {p.instance_id, d.instance_id} <= set(roster(sched)), what="registration")
    waves = [_work(6, 200 + 100 * k) for k in range(4)]
    refs = [[ref.generate(q, imgs, max_tokens=MAX_TOKENS) for q, imgs in w] for w in waves]
    outs = []

    def d_steps() -> int:
        return d.workers[0].load.counts.engine_steps

    with Client(sched.address, timeout=300) as c:
        def wave_with_switch(work, roles):
            results: dict = {}
            t = threading.Thread(target=lambda: results.update(out=_run(c, work)))
            t.start()
            wait_until(lambda: any(w.handles for h in (p, d) for w in h.workers), timeout_s=60,
                       what="requests in flight")
            assert _switch(p, roles, "coupling move").instance.roles == roles
            t.join(300)
            return results["out"]

        outs.append(wave_with_switch(waves[0], "EPD"))  # merge
        before = d_steps()
        outs.append(_run(c, waves[1]))  # merged: all on the coupled engine
        assert d_steps() == before, "a parked D decoded"
        assert roster(sched)[p.instance_id].roles == "EPD" and p.workers[0].load.counts.engine_steps > 0
        outs.append(wave_with_switch(waves[2], "P+E"))  # split
        before = d_steps()
        outs.append(_run(c, waves[3]))
        assert d_steps() > before, "the split pair did not decode on D"
    assert [[list(o.token_ids) for o in w] for w in outs] == refs
    assert not _retries(caplog)
    assert roster(sched)[p.instance_id].roles == "P+E"


class _OverlappedSwitch:
    """Long decodes running on `host`'s first worker, then its switch to `roles` (threads): the two
    overlap tests' shared set-up. Entered once the new id is on the roster, with `old_worker`
    retiring; `finish()` waits for both and returns (long outputs, SwitchRoles response)."""

    def __init__(self, sched, client, host, work, max_tokens: int, roles: str):
        self.sched, self.host, self.roles, self.old_id = sched, host, roles, host.instance_id
        self.results: dict = {}
        self._long = threading.Thread(target=lambda: self.results.update(long=_run(client, work, max_tokens)))
        self._long.start()
        wait_until(lambda: len(host.workers[0].handles) == len(work), timeout_s=60, what="long decodes running")
        self.old_worker = host.workers[0]
        self._switch = threading.Thread(target=lambda: self.results.update(switch=_switch(host, roles, "overlap")))
        self._switch.start()
        wait_until(lambda: host.instance_id != self.old_id and host.instance_id in roster(sched), timeout_s=60,
                   what="the new id registered")
        assert roster(sched)[self.old_id].draining and host.retiring == [self.old_worker]

    def finish(self):
        self._switch.join(300)
        self._long.join(300)
        resp = self.results["switch"]
        assert resp.previous_instance_id == self.old_id and resp.instance.roles == self.roles
        assert not self.host.retiring and self.old_id not in roster(self.sched)
        return self.results["long"], resp


def test_an_overlapped_split_serves_new_requests_while_the_coupled_decodes_drain(sched, start, ref, caplog):
    """EPD (the D parked beside it) -> P+E with long decodes running on the coupled engine: the new
    P+E workers start beside it and take the next requests at once (prefill here, decode on the D)
    while the old engine finishes its decodes; drained first, those requests would wait for the
    longest of them. Every output equal to transformers', nothing retried, the old id gone after."""
    caplog.set_level(logging.INFO)
    p, d = start("EPD", "on"), start("D")
    wait_until(lambda: {p.instance_id, d.instance_id} <= set(roster(sched)), what="registration")
    model_before = p.model
    long_work, short_work = _work(3, 700), _work(4, 800)
    long = 600  # the coupled engine's decodes: far longer than a short request's whole path
    long_refs = [ref.generate(q, imgs, max_tokens=long) for q, imgs in long_work]
    short_refs = [ref.generate(q, imgs, max_tokens=8) for q, imgs in short_work]
    with Client(sched.address, timeout=300) as c:
        sw = _OverlappedSwitch(sched, c, p, long_work, long, "P+E")
        d_before = d.workers[0].load.counts.engine_steps
        shorts = _run(c, short_work, 8)
        assert sw.old_worker.handles, "the long decodes ended before the short requests: the test proves nothing"
        assert d.workers[0].load.counts.engine_steps > d_before  # the short ones decoded on the unparked D
        longs, resp = sw.finish()
    assert [list(o.token_ids) for o in longs] == long_refs
    assert [list(o.token_ids) for o in shorts] == short_refs
    assert resp.drain_s > 0 and p.model is model_before
    assert roster(sched)[p.instance_id].roles == "P+E"
    assert not _retries(caplog)


def test_an_overlapped_switch_that_keeps_a_stage_hands_new_calls_to_the_new_worker(sched, start, ref, caplog):
    """D -> ED overlapped, decodes running: the old D worker finishes them over its KV pairs while
    the new ED's D worker (new id, new pairs) takes the decodes of requests arriving meanwhile —
    the one stage both role sets serve. Every output equal to transformers', nothing retried."""
    caplog.set_level(logging.INFO)
    e, p, d = start("E"), start("P"), start("D", "on")
    wait_until(lambda: {h.instance_id for h in (e, p, d)} <= set(roster(sched)), what="registration")
    long_work, short_work = _work(3, 1000), _work(4, 1100)
    long_refs = [ref.generate(q, imgs, max_tokens=500) for q, imgs in long_work]
    short_refs = [ref.generate(q, imgs, max_tokens=8) for q, imgs in short_work]
    with Client(sched.address, timeout=300) as c:
        sw = _OverlappedSwitch(sched, c, d, long_work, 500, "ED")
        new_d = d.worker("D")
        assert new_d is not sw.old_worker
        shorts = _run(c, short_work, 8)
        assert sw.old_worker.handles, "the long decodes ended before the short requests: the test proves nothing"
        assert new_d.load.counts.engine_steps > 0  # the short ones decoded on the new worker
        longs, _ = sw.finish()
    assert [list(o.token_ids) for o in longs] == long_refs
    assert [list(o.token_ids) for o in shorts] == short_refs
    assert not _retries(caplog)


def test_an_overlapped_switch_whose_new_workers_cannot_start_changes_nothing(sched, start, ref, monkeypatch):
    """The new workers fail to start: the switch is refused, the old ones never stopped taking work
    (no drain happened) and the instance serves as before under its old id."""
    a = start("PD", "on")
    wait_until(lambda: a.instance_id in roster(sched), what="registration")
    old_id, old_worker = a.instance_id, a.workers[0]

    def broken(roles, instance_id, timeout_s):
        raise RuntimeError("no memory for a second KV cache")

    monkeypatch.setattr(a, "_build_workers", broken)
    with pytest.raises(grpc.RpcError) as e:
        _switch(a, "EPD")
    assert e.value.code() == grpc.StatusCode.FAILED_PRECONDITION and "still PD" in e.value.details()
    assert a.instance_id == old_id and a.workers == [old_worker] and not a.retiring
    assert not roster(sched)[old_id].draining
    work = _work(2, 900)
    with Client(sched.address, timeout=300) as c:
        outs = _run(c, work, 8)
    assert [list(o.token_ids) for o in outs] == [ref.generate(q, imgs, max_tokens=8) for q, imgs in work]


def test_an_encoder_switching_away_costs_its_requests_no_retry(sched, start, ref, caplog):
    """E -> D while requests it encoded for are still prefilling or decoding elsewhere: its old id
    leaves the roster, which must not abandon their attempts (it had done its part; a CI-sized
    shift run retried 3 requests this way). Later images are recomputed by P (no E left)."""
    caplog.set_level(logging.INFO)
    e, p, d = (start(r) for r in ("E", "P", "D"))
    hosts = [e, p, d]
    wait_until(lambda: {h.instance_id for h in hosts} <= set(roster(sched)), what="registration")
    work = [(f"Request {600 + i}: {PH} describe.", [image(600 + i, 56 + 28 * (i % 2), 56)]) for i in range(8)]
    long = 160  # decodes that outlast the E's drain and rebuild
    refs = [ref.generate(q, imgs, max_tokens=long) for q, imgs in work]
    old_e = e.instance_id
    with Client(sched.address, timeout=300) as c:
        results: dict = {}
        t = threading.Thread(target=lambda: results.update(out=_run(c, work, long)))
        t.start()
        wait_until(lambda: e.workers[0].load.counts.images_encoded >= 1 and any(w.handles for w in d.workers), timeout_s=60,
                   what="requests past their encode")
        assert _switch(e, "D", "an encoder moving away").instance.roles == "D"
        assert t.is_alive(), "every request ended before the switch: the test proves nothing"
        t.join(300)
    assert [list(o.token_ids) for o in results["out"]] == refs
    assert old_e not in roster(sched)
    assert not _retries(caplog)
