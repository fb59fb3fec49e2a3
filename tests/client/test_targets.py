"""Several schedulers behind one client: a gRPC target that resolves to several addresses (as a
Kubernetes Service name does; here gRPC's ipv4: resolver with two, no DNS server needed) or a
list. One scheduler is killed mid-stream; the stream goes on from the other, exactly."""
import pytest

from epdserve.client import Client
from epdserve.client.connection import addresses_of
from tests.client.token_scheduler import TokenScheduler, tokens_for


def test_targets_parse():
    assert addresses_of("a:1, b:2") == ["a:1", "b:2"]
    assert addresses_of(["a:1", "b:2"]) == ["a:1", "b:2"]
    assert addresses_of("dns:///scheduler.epd.svc.cluster.local:50051") == [
        "dns:///scheduler.epd.svc.cluster.local:50051"]
    assert addresses_of("ipv4:10.0.0.1:1,10.0.0.2:1") == ["ipv4:10.0.0.1:1,10.0.0.2:1"]  # one target
    with pytest.raises(ValueError):
        addresses_of(" , ")


@pytest.mark.timeout(120)
@pytest.mark.parametrize("form", ["resolver", "list"])
def test_the_scheduler_serving_a_stream_killed_the_other_takes_over(form):
    """a serves the stream (b is not up yet: round_robin sends calls to connected addresses only,
    a list starts with a); b comes up, a is killed: the stream resumes on b, exactly."""
    prompt, n = f"two schedulers ({form})", 150  # 4.5 s: b is up and a killed long before the end
    with TokenScheduler(0.03) as a, TokenScheduler(0.03) as b:
        b.kill()
        target = f"ipv4:127.0.0.1:{a.port},127.0.0.1:{b.port}" if form == "resolver" else [a.address, b.address]
        with Client(target, timeout=60, retry_deadline_s=10, retry_backoff_s=0.05, retry_max_backoff_s=0.2) as c:
            ids = []
            for d in c.generate_stream(prompt, max_tokens=n):
                ids.extend(d.token_ids)
                if len(ids) == 5 and a.proc is not None:
                    b.start()
                    a.kill()
            assert ids == tokens_for(prompt, n) and c.retried >= 1
            for _ in range(3):  # the next requests go to the survivor
                assert c.generate(prompt, max_tokens=5).token_ids == tokens_for(prompt, 5)
