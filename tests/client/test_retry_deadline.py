"""The client's retry budget is a deadline, not a count: a scheduler killed mid-stream and started
again later than the old budget (8 doubling retries) would have waited still gets every request
resumed, exactly; past the deadline the call fails UNAVAILABLE. Real gRPC, a real stand-in
scheduler process (token_scheduler.py), deadlines scaled down so the tests take seconds."""
import asyncio
import threading
import time

import grpc
import pytest

from epdserve.client import AsyncClient, Client, EPDServeError, RetryPolicy
from epdserve.net import free_port
from tests.client.token_scheduler import TokenScheduler, tokens_for

BACKOFF = dict(retry_backoff_s=0.05, retry_max_backoff_s=0.2)
OLD_BUDGET_S = sum(RetryPolicy(backoff_s=0.05, max_backoff_s=0.2).wait_s(n) for n in range(1, 9))  # 1.35 s


def test_policy_waits_double_up_to_the_cap_and_end_on_the_deadline():
    p = RetryPolicy(deadline_s=1.0, backoff_s=0.1, max_backoff_s=0.3)
    assert [p.wait_s(n) for n in range(1, 5)] == [0.1, 0.2, 0.3, 0.3]
    err = EPDServeError(grpc.StatusCode.UNAVAILABLE, "gone")
    now = time.monotonic()
    assert p.wait_after(err, 1, now, None) == pytest.approx(0.1, abs=0.01)
    assert p.wait_after(err, 9, now - 0.95, None) == pytest.approx(0.05, abs=0.02)  # the last try falls on the deadline
    with pytest.raises(EPDServeError):
        p.wait_after(err, 2, now - 1.0, None)  # the deadline has passed
    with pytest.raises(EPDServeError):
        p.wait_after(EPDServeError(grpc.StatusCode.INVALID_ARGUMENT, "no"), 1, now, None)
    with pytest.raises(EPDServeError):
        RetryPolicy(retries=0).wait_after(err, 1, now, None)
    assert RetryPolicy().deadline_s >= 60


def _restart_later(sched: TokenScheduler, after_s: float) -> threading.Thread:
    def run():
        time.sleep(after_s)
        sched.start()
    t = threading.Thread(target=run, daemon=True)
    t.start()
    return t


@pytest.mark.timeout(120)
def test_a_scheduler_back_later_than_the_old_budget_loses_nothing():
    prompt, n = "a lost scheduler", 40
    with TokenScheduler(token_delay_s=0.02) as sched:
        with Client(sched.address, timeout=60, retry_deadline_s=15, **BACKOFF) as c:
            ids, restarter = [], None
            for d in c.generate_stream(prompt, max_tokens=n):
                ids.extend(d.token_ids)
                if len(ids) == 10 and restarter is None:
                    sched.kill()
                    restarter = _restart_later(sched, OLD_BUDGET_S + 1.5)  # down longer than the old budget
            restarter.join()
            assert ids == tokens_for(prompt, n) and c.retried >= 9  # more tries than the old count allowed


@pytest.mark.timeout(120)
def test_async_client_resumes_the_same_way():
    prompt, n = "async", 30

    restarters = []

    async def main(sched):
        async with AsyncClient(sched.address, timeout=60, retry_deadline_s=15, **BACKOFF) as c:
            ids = []
            async for d in c.generate_stream(prompt, max_tokens=n):
                ids.extend(d.token_ids)
                if len(ids) == 5 and sched.proc is not None:
                    sched.kill()
                    restarters.append(_restart_later(sched, OLD_BUDGET_S + 1.0))
            return ids, c.retried

    with TokenScheduler(token_delay_s=0.02) as sched:
        ids, retried = asyncio.run(main(sched))
        for t in restarters:  # the client may resume before the restarter saw the server ready:
            t.join()  # wait for it before the server is stopped under it
    assert ids == tokens_for(prompt, n) and retried >= 9 and len(restarters) == 1


def test_past_the_deadline_the_call_is_unavailable():
    with Client(f"127.0.0.1:{free_port()}", retry_deadline_s=1.0, **BACKOFF) as c:
        with pytest.raises(EPDServeError) as e:
            c.generate("anyone?", max_tokens=4)
    assert e.value.code == grpc.StatusCode.UNAVAILABLE
    assert c.retried >= 5  # 0.05, 0.1, 0.2, 0.2 ... until the deadline, then UNAVAILABLE
