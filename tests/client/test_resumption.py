"""The resume-and-retry loop both clients wrap (`resume.Resumption`), driven step by step without
a server: each attempt resumes after every token delivered so far, tokens delivered start a new
budget, and the policy's refusal is the caller's error. (The clients around it, over real gRPC:
test_retry_deadline.py, test_targets.py.)"""
import grpc
import pytest

from epdserve.client import EPDServeError, RetryPolicy
from epdserve.client.resume import Resumption
from epdserve.rpc import serve_pb2

LOST = EPDServeError(grpc.StatusCode.UNAVAILABLE, "scheduler gone")


def _request() -> serve_pb2.GenerateRequest:
    return serve_pb2.GenerateRequest(request_id="r1", prompt="Hello")


def test_each_attempt_resumes_after_every_token_delivered():
    run = Resumption(_request(), RetryPolicy(deadline_s=10.0, backoff_s=0.1, max_backoff_s=0.4), None)
    first, left = run.attempt()
    assert list(first.resume_token_ids) == [] and left is None
    run.delivered([7, 8])
    assert run.failed(LOST) == pytest.approx(0.1)
    second, _ = run.attempt()
    assert list(second.resume_token_ids) == [7, 8] and second.prompt == "Hello"
    run.delivered([9])
    run.failed(LOST)
    third, _ = run.attempt()
    assert list(third.resume_token_ids) == [7, 8, 9]


def test_failures_in_a_row_double_the_wait_and_tokens_start_a_new_budget():
    run = Resumption(_request(), RetryPolicy(deadline_s=10.0, backoff_s=0.1, max_backoff_s=0.4), None)
    waits = []
    for _ in range(4):
        run.attempt()
        waits.append(run.failed(LOST))
    assert waits == pytest.approx([0.1, 0.2, 0.4, 0.4])
    run.attempt()
    run.delivered([5])
    assert run.failed(LOST) == pytest.approx(0.1) and run.failures == 1


def test_the_policy_refusing_raises_the_attempts_own_error():
    run = Resumption(_request(), RetryPolicy(retries=1), None)
    run.attempt()
    run.failed(LOST)
    run.attempt()
    with pytest.raises(EPDServeError) as e:
        run.failed(LOST)
    assert e.value is LOST
    bad = EPDServeError(grpc.StatusCode.INVALID_ARGUMENT, "no")
    fresh = Resumption(_request(), RetryPolicy(), None)
    fresh.attempt()
    with pytest.raises(EPDServeError) as e:
        fresh.failed(bad)
    assert e.value is bad


def test_the_calls_timeout_bounds_every_attempt():
    run = Resumption(_request(), RetryPolicy(backoff_s=5.0), timeout=1.0)
    _, left = run.attempt()
    assert 0.0 < left <= 1.0
    with pytest.raises(EPDServeError):
        run.failed(LOST)  # a 5 s backoff would pass the call's 1 s deadline
