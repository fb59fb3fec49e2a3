"""Cache-aware routing end to end: a real scheduler in front of two coupled EPD instances (real
LLMEngines on the tiny Qwen2-VL checkpoint behind real gRPC servers). A conversation's second
turn goes to the instance that served its first; under a hot prefix with load the other
instance still gets work; a killed instance drops out of the index."""
import pytest

from epdserve import Client
from tests.scheduler.engine_instance import EngineInstance
from tests.scheduler.harness import image, start_scheduler, wait_until

SYSTEM = "You are a careful assistant who describes pictures in detail and answers follow-up questions. " * 3


@pytest.fixture
def two(qwen2_vl_tiny):
    insts = [EngineInstance(qwen2_vl_tiny, f"epd{i}").start() for i in range(2)]
    yield insts
    for i in insts:
        i.stop()


def served_by(insts, request_id: str) -> str:
    """The instance that ran the request's first attempt."""
    return next(i.instance_id for i in insts if f"{request_id}#1" in i.requests_seen)


def turns(img: bytes, *texts: str, system: str = SYSTEM) -> list[dict]:
    msgs = [{"role": "system", "content": [{"type": "text", "text": system}]}]
    for n, text in enumerate(texts):
        content = [{"type": "text", "text": text}]
        if n == 0:
            content.insert(0, {"type": "image", "image": img})
        msgs.append({"role": "user" if n % 2 == 0 else "assistant", "content": content})
    return msgs


def test_second_turns_go_home_and_a_hot_prefix_still_spreads(qwen2_vl_tiny, two):
    sched = start_scheduler(qwen2_vl_tiny, two)
    index = sched.server.router.index
    try:
        with Client(sched.address, timeout=120) as c:
            first = {}
            for conv in range(4):  # one at a time, each on idle instances; nothing shared between them
                system = f"Conversation {conv}. {SYSTEM}"
                r = c.chat(turns(image(20 + conv), "What is here?", system=system), max_tokens=6,
                           request_id=f"c{conv}-t1")
                first[conv] = (served_by(two, f"c{conv}-t1"), r.text)
            assert {home for home, _ in first.values()} == {"epd0", "epd1"}  # cold prompts: round-robin
            for conv, (home, answer) in first.items():
                system = f"Conversation {conv}. {SYSTEM}"
                c.chat(turns(image(20 + conv), "What is here?", answer or "Colours.", "And what else?", system=system),
                       max_tokens=6, request_id=f"c{conv}-t2")
                assert served_by(two, f"c{conv}-t2") == home, conv

            # a hot prefix: every request shares the conversation so far; each stays in flight
            hot = turns(image(30), "Hot question?")
            c.chat(hot, max_tokens=4, request_id="hot-warm")
            streams = []
            for k in range(4):
                s = c.chat_stream(turns(image(30), "Hot question?", "Colours.", f"Follow-up {k}?"),
                                  max_tokens=2000, ignore_eos=True, request_id=f"hot{k}")
                next(s)  # routed and running
                streams.append(s)
            where = [served_by(two, f"hot{k}") for k in range(4)]
            for s in streams:
                s.close()
        assert served_by(two, "hot0") == served_by(two, "hot-warm")  # idle: the prefix's home
        assert set(where) == {"epd0", "epd1"}, where  # loaded: the other instance gets work too
        assert sched.call(index.instances) == ["epd0", "epd1"]
    finally:
        sched.stop()


def test_a_killed_instance_drops_out_of_the_index(qwen2_vl_tiny, two):
    sched = start_scheduler(qwen2_vl_tiny, two, unhealthy_after=2)
    index = sched.server.router.index
    try:
        with Client(sched.address, timeout=120) as c:
            for k in range(2):  # cold prompts, one at a time: one on each instance
                c.chat(turns(image(40 + k), "What is here?", system=f"Chat {k}. {SYSTEM}"), max_tokens=4,
                       request_id=f"k{k}")
            assert sched.call(index.instances) == ["epd0", "epd1"]
            victim = served_by(two, "k0")
            survivor = "epd1" if victim == "epd0" else "epd0"
            next(i for i in two if i.instance_id == victim).kill()
            wait_until(lambda: sched.call(index.instances) == [survivor], what="the dead instance to leave the index")
            c.chat(turns(image(40), "What is here?", system=f"Chat 0. {SYSTEM}"), max_tokens=4, request_id="after")
            assert served_by(two, "after") == survivor
    finally:
        sched.stop()
