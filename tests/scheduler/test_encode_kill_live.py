"""Nothing lost when an E instance dies mid-request: a real E-P-D deployment (instance processes,
two E, a real MM Store) serves a 3-image request; the E instance that holds its third (large)
image is SIGKILLed while that Encode call is in flight. The prefilling instance, which pipelined
the prompt up to that image meanwhile, recomputes it after its bounded wait: the request
completes with the offline engine's greedy tokens, its timing shows prefill started before the
last encode ended, and the other E still serves."""
import signal
from concurrent.futures import ThreadPoolExecutor

import pytest


from epdserve import Client  # noqa: E402
from epdserve.model.demo_images import jpeg_bytes, procedural_image  # noqa: E402
from tests.scheduler.harness import image, instance_deployment, PH, wait_until  # noqa: E402

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def deployment(qwen2_vl_tiny):
    instances = (("e0", "E"), ("e1", "E"), ("p0", "P"), ("d0", "D"))
    with instance_deployment(qwen2_vl_tiny, instances, "--feature-wait-s", "2") as (sched, procs, _):
        yield sched, procs


def _encoder_of_item(sched, rid: str, item: int):
    """(instance id, its Encode still in flight) for prompt item `item` of request `rid`, or None."""
    def look():
        run = sched.server.dispatcher.runs.get(("", rid))  # (tenant, request id): the default tenant
        if run is None or run.attempt is None:
            return None
        for rec, items in run.attempt.plan.encodes:
            if item in items:
                return rec.instance_id, rec.outstanding["E"] > 0
        return None
    return sched.call(look)


def test_e_killed_while_the_third_image_encodes_loses_nothing(deployment, offline):
    sched, procs = deployment
    prompt = f"compare {PH} with {PH} and with {PH} please"
    images = [image(61), image(62), jpeg_bytes(procedural_image(1280, 720, seed=63))]
    with Client(sched.address, timeout=300) as c, ThreadPoolExecutor(1) as pool:
        stream = c.generate_stream(prompt, images=images, max_tokens=8, ignore_eos=True, request_id="kill-e")
        consumed = pool.submit(list, stream)  # the call goes out as the stream is read
        found = []
        wait_until(lambda: found.append(_encoder_of_item(sched, "kill-e", 2)) or found[-1] is not None,
                   60, "the third image's Encode call")
        victim, in_flight = found[-1]
        assert in_flight, "the third image's Encode answered before it could be killed"
        procs[victim].send_signal(signal.SIGKILL)
        deltas = consumed.result(300)
    tokens = [t for d in deltas for t in d.token_ids]
    assert tokens == offline(prompt, images, 8, ignore_eos=True)
    last = deltas[-1]
    assert last.timing.prefill_start < last.timing.encode_end  # pipelined: P started before the last item was in
    survivor = "e1" if victim == "e0" else "e0"
    with Client(sched.address, timeout=300) as c:  # the other E still serves
        again = c.generate(f"one more {PH}", images=[image(64)], max_tokens=4)
    assert again.token_ids == offline(f"one more {PH}", [image(64)], 4)
    assert sched.call(lambda: sched.server.registry.get(survivor).health) == 1  # HEALTHY
