"""A tenant's tokens in flight are bounded (`max_tokens_per_tenant`, issue 51 item 2): each request's
prompt tokens plus n x max_tokens, counted once the prompt is tokenized. A request over the limit
alone is refused at once (INVALID_ARGUMENT naming the flag); one that would push the tenant past it
while its other requests run is RESOURCE_EXHAUSTED (retry later) and is served once they end. Real
scheduler and instances on loopback, no keys file: every caller is the
default tenant."""
import grpc
import pytest

from epdserve import Client
from epdserve.client import EPDServeError
from tests.scheduler.harness import start_scheduler, wait_until

QUOTA = 300


@pytest.fixture(scope="module")
def sched(qwen2_vl_tiny, two_instances):
    s = start_scheduler(qwen2_vl_tiny, two_instances, max_tokens_per_tenant=QUOTA)
    yield s
    s.stop()


def _in_flight(sched) -> dict:
    return sched.call(lambda: dict(sched.server.dispatcher._tokens_per_tenant))


def test_tokens_in_flight_are_bounded_per_tenant(sched):
    with Client(sched.address, timeout=120, retries=0) as c:
        with pytest.raises(EPDServeError) as e:
            c.generate("too long alone", max_tokens=QUOTA + 1)
        assert e.value.code == grpc.StatusCode.INVALID_ARGUMENT and "--max-tokens-per-tenant" in e.value.details
        stream = c.generate_stream("hold most of the quota", max_tokens=250, ignore_eos=True)
        next(stream)
        held = _in_flight(sched)
        assert list(held.values()) and 250 < sum(held.values()) <= QUOTA
        with pytest.raises(EPDServeError) as e:
            c.generate("one more", max_tokens=100)
        assert e.value.code == grpc.StatusCode.RESOURCE_EXHAUSTED and "tokens in flight" in e.value.details
        assert sum(len(d.token_ids) for d in stream) > 0  # the held one runs to its end ...
        wait_until(lambda: not _in_flight(sched), what="the tenant's tokens to be released")
        assert c.generate("one more", max_tokens=100, ignore_eos=True).usage.output_tokens == 100  # ... then it fits
