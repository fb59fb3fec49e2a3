"""The role controller wired into a real scheduler (`--controller`): real instance hosts register,
traffic flows, the controller sees the front stage miss its SLO, decides a move, and carries it out
through Instance.SwitchRoles while requests are in flight — every request sent answered (the test
counts them, and records every error of the traffic thread), every output equal to transformers'
own processor and `generate` (`tests.hf_oracle`), no request retried, the decision logged with its
reason."""
from __future__ import annotations

import logging
import threading
from concurrent.futures import ThreadPoolExecutor

import pytest

from epdserve.client import Client
from epdserve.instance.config import InstanceConfig
from epdserve.instance.host import InstanceHost
from epdserve.scheduler import SchedulerConfig, SchedulerThread
from epdserve.scheduler.controller import ControllerConfig, Outcome
from epdserve.scheduler.pressure import PressureConfig
from epdserve.transfer.mm_store.server import LocalRedisServer
from tests.hf_oracle import HFOracle
from tests.instance.harness import PH, image, wait_until
from tests.instance.test_registration import roster

pytestmark = pytest.mark.slow
MAX_TOKENS = 12


def _work(i: int) -> tuple[str, list[bytes]]:
    k = i % 2
    return (f"Request {i}: " + (f"{PH} describe." if k else "say hi."), [image(200 + i, 56 + 28 * (i % 3), 56)] * k)


def test_the_controller_moves_an_instance_and_loses_nothing(qwen2_vl_tiny, caplog):
    caplog.set_level(logging.INFO)
    ctl = ControllerConfig(tick_s=0.3, min_dwell_s=0.0, cooldown_s=600.0, min_samples=2,
                           slo_ttft_ms=1.0, slo_tpot_ms=60_000.0,  # every first token is late: the front stage is hot
                           pressure=PressureConfig(window_s=5.0, min_slo_requests=3),
                           stage_moves="on")  # the instances share this host's cores: auto would not move them
    sched = SchedulerThread(SchedulerConfig(model=str(qwen2_vl_tiny), heartbeat_interval_s=0.2, probe_interval_s=0.2,
                                            controller=ctl))
    sched.start()
    hosts = []
    ref = HFOracle(qwen2_vl_tiny)
    try:
        with LocalRedisServer() as redis:
            for roles in ("EP", "D", "D"):
                hosts.append(InstanceHost(InstanceConfig(roles=roles, model=str(qwen2_vl_tiny), scheduler=sched.server.internal_address,
                                                         mm_store=redis.url, kv_cache_bytes=4 << 20,
                                                         feature_wait_s=5.0)).start())
            wait_until(lambda: len(roster(sched)) == 3, what="registration")
            before = sorted(s.roles for s in roster(sched).values())
            controller = sched.server.controller
            sent, outs, errors, stop = [], {}, [], threading.Event()

            def one(c, j):
                try:
                    outs[j] = list(c.generate(*_work(j), max_tokens=MAX_TOKENS, ignore_eos=True).token_ids)
                except BaseException as e:  # every error is recorded, none dropped with the thread
                    errors.append(f"request {j}: {type(e).__name__}: {e}")

            def traffic():
                try:
                    with Client(sched.address, timeout=300) as c, ThreadPoolExecutor(4) as pool:
                        i = 0
                        while not stop.is_set() and i < 400:
                            batch = list(range(i, i + 4))
                            sent.extend(batch)
                            list(pool.map(lambda j: one(c, j), batch))
                            i += 4
                except BaseException as e:
                    errors.append(f"traffic: {type(e).__name__}: {e}")

            t = threading.Thread(target=traffic)
            t.start()
            try:
                moves = []  # kept as seen: `decisions` holds only the recent ones, a long run pushes the move out

                def moved() -> bool:
                    moves.extend(sched.call(lambda: [d for d in controller.decisions if d.outcome is Outcome.MOVE]))
                    return bool(moves)

                wait_until(moved, timeout_s=120, what="a move")
                def switched(now) -> bool:  # one roster snapshot: roles and draining as of the same moment
                    return sorted(s.roles for s in now.values()) != before and not any(s.draining for s in now.values())

                wait_until(lambda: switched(roster(sched)), timeout_s=120, what="the switch")
                on_new = len(outs) + 8
                wait_until(lambda: len(outs) >= on_new or errors, timeout_s=120, what="requests on the new roster")
            finally:
                stop.set()
                t.join(300)
            assert not t.is_alive() and errors == []
            assert sorted(outs) == sent  # every request sent was answered
            move = moves[0]
            assert move.reason and move.move.from_roles != move.move.to_roles
            assert len(roster(sched)) == 3 and outs
            for j, tokens in outs.items():
                prompt, imgs = _work(j)
                assert tokens == ref.generate(prompt, imgs, MAX_TOKENS, ignore_eos=True), f"request {j}"
            failures = [r.getMessage() for r in caplog.records if "attempt" in r.getMessage() and "failed" in r.getMessage()]
            assert not failures
    finally:
        for h in hosts:
            h.stop()
        sched.stop()
