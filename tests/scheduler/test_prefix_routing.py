"""Cache-aware routing's parts on real prompts (the scheduler's own preprocessor on the tiny
Qwen2-VL checkpoint): prompt block hashes (a conversation's next turn extends its first, another
image stops the match at its first block), the per-instance prefix index (longest run, LRU bound,
tail-first eviction, forgetting a dead or restarted instance) and the router's cost rule, with
each instance's prefix counted in blocks of its registered size."""
import pytest

from epdserve.rpc import common_pb2, serve_pb2
from epdserve.scheduler.prefix_index import PrefixIndex
from epdserve.scheduler.preprocess import RequestPreprocessor
from epdserve.scheduler.prompt_chunks import DEFAULT_BLOCK_SIZE as CHUNK_TOKENS, PromptChunker
from epdserve.scheduler.registry import InstanceRegistry
from epdserve.scheduler.routing import Router
from tests.scheduler.harness import image

SYSTEM = "You are a careful assistant who describes pictures in detail and answers follow-up questions. " * 3


@pytest.fixture(scope="module")
def pre(qwen2_vl_tiny):
    return RequestPreprocessor(str(qwen2_vl_tiny))


@pytest.fixture(scope="module")
def chunker(pre):
    return PromptChunker((pre.image_token_id, pre.processor.video_token_id))


def chat(*turns, img=image(0)):
    """A chat request: system, then user/assistant texts alternating; the first user turn has `img`."""
    msgs = [serve_pb2.ChatMessage(role="system", content=[serve_pb2.ContentPart(text=SYSTEM)])]
    for i, text in enumerate(turns):
        parts = [serve_pb2.ContentPart(text=text)]
        if i == 0:
            parts.insert(0, serve_pb2.ContentPart(image=common_pb2.Media(data=img)))
        msgs.append(serve_pb2.ChatMessage(role="user" if i % 2 == 0 else "assistant", content=parts))
    return serve_pb2.GenerateRequest(chat=serve_pb2.Chat(messages=msgs))


def prepared(pre, chunker, req):
    prep = pre.prepare(req, "ns")
    return prep, chunker.hashes(prep.prompt_token_ids, prep.media)


def test_next_turn_extends_the_first_turns_chunks(pre, chunker):
    p1, h1 = prepared(pre, chunker, chat("What is in this picture?"))
    p2, h2 = prepared(pre, chunker, chat("What is in this picture?", "A pattern of colours.", "Which colour most?"))
    assert len(h1) == len(p1.prompt_token_ids) // CHUNK_TOKENS >= 4
    assert len(h2) > len(h1) and h2[:len(h1)] == h1
    assert len(set(h2)) == len(h2)  # chained: no two chunks alike, even of equal tokens


def test_another_image_stops_the_match_at_its_first_chunk(pre, chunker):
    a, ha = prepared(pre, chunker, chat("Describe it.", img=image(0)))
    b, hb = prepared(pre, chunker, chat("Describe it.", img=image(6)))  # same size: same tokens, another key
    assert a.prompt_token_ids == b.prompt_token_ids and a.media[0].key != b.media[0].key
    first = a.prompt_token_ids.index(pre.image_token_id) // CHUNK_TOKENS
    assert ha[:first] == hb[:first] and first > 0
    assert all(x != y for x, y in zip(ha[first:], hb[first:]))


def test_text_prompts_without_media_and_short_prompts(chunker):
    ids = list(range(100, 150))
    assert chunker.hashes(ids) == chunker.hashes(ids + [7])[:3] and len(chunker.hashes(ids)) == 3
    assert chunker.hashes(ids[:CHUNK_TOKENS - 1]) == []


def records(*specs, block_size=0):
    reg = InstanceRegistry()
    for iid, roles in specs:
        reg.register(common_pb2.InstanceStatus(instance_id=iid, roles=roles, address=f"h:{iid}", pid=1,
                                               block_size=block_size))
    return reg


def test_index_longest_run_lru_bound_and_tail_first_eviction():
    reg = records(("a", "EPD"))
    a = reg.get("a")
    idx = PrefixIndex(capacity=6)
    idx.record(a, [1, 2, 3, 4])
    assert idx.matched(a, [1, 2, 3, 4, 5]) == 4 and idx.matched(a, [1, 9, 3]) == 1 and idx.matched(a, [2]) == 1
    idx.record(a, [10, 11, 12, 13])  # over capacity: the oldest prompt's tail goes first
    assert idx.size("a") == 6
    assert idx.matched(a, [1, 2, 3, 4]) == 2 and idx.matched(a, [10, 11, 12, 13]) == 4


def test_index_forgets_an_instance_and_a_restarted_process():
    reg = records(("a", "EPD"), ("b", "EPD"))
    idx = PrefixIndex()
    idx.record(reg.get("a"), [1, 2])
    idx.record(reg.get("b"), [1, 2])
    idx.forget("a")
    assert idx.matched(reg.get("a"), [1, 2]) == 0 and idx.instances() == ["b"]
    reg.register(common_pb2.InstanceStatus(instance_id="b", roles="EPD", address="h:b", pid=2))  # restarted
    assert idx.matched(reg.get("b"), [1, 2]) == 0 and idx.instances() == []


def test_router_sends_a_held_prefix_home_until_its_queue_outweighs_the_prefix(pre, chunker):
    reg = records(("c0", "EPD"), ("c1", "EPD"))
    router = Router(reg)
    p1, h1 = prepared(pre, chunker, chat("What is in this picture?"))
    p2, h2 = prepared(pre, chunker, chat("What is in this picture?", "Colours.", "Which colour most?"))
    n1, n2 = len(p1.prompt_token_ids), len(p2.prompt_token_ids)
    plan1, lease1 = router.plan(n1, 8, [], [], prefix={CHUNK_TOKENS: h1})
    home = plan1.coupled.instance_id
    other = "c1" if home == "c0" else "c0"
    assert plan1.prefix_tokens == 0 and reg.get(home).outstanding["PD"] == n1 + 8
    lease1.release()
    # idle: the second turn goes where the first went, leasing only what is not cached
    plan2, lease2 = router.plan(n2, 8, [], [], prefix={CHUNK_TOKENS: h2})
    assert plan2.coupled.instance_id == home and plan2.prefix_tokens == len(h1) * CHUNK_TOKENS
    assert reg.get(home).outstanding["PD"] == n2 - plan2.prefix_tokens + 8
    lease2.release()
    # the same turn again (home now holds all of its chunks) while home has queued more than
    # that prefix saves: the other instance; one token less, still home
    held = len(h2) * CHUNK_TOKENS
    reg.get(home).outstanding["PD"] = held
    plan3, lease3 = router.plan(n2, 8, [], [], prefix={CHUNK_TOKENS: h2})
    assert plan3.coupled.instance_id == home and plan3.prefix_tokens == held
    lease3.release()
    reg.get(home).outstanding["PD"] = held + 1
    plan3, lease3 = router.plan(n2, 8, [], [], prefix={CHUNK_TOKENS: h2})
    assert plan3.coupled.instance_id == other and plan3.prefix_tokens == 0
    lease3.release()
    # ... which holds it from then on: with equal queues the longer held prefix wins, on either
    reg.get(home).outstanding["PD"] = 0
    assert router.index.matched(reg.get(other), h2) == len(h2)


def test_router_least_load_policy_and_split_mode(pre, chunker):
    _, h = prepared(pre, chunker, chat("What is in this picture?"))
    reg = records(("c0", "EPD"), ("c1", "EPD"))
    router = Router(reg, policy="least-load")
    picks = [router.plan(100, 8, [], [], prefix={CHUNK_TOKENS: h})[0].coupled.instance_id for _ in range(4)]
    assert picks == ["c0", "c1", "c0", "c1"] and router.index.instances() == []  # round-robin, nothing recorded
    with pytest.raises(ValueError):
        Router(reg, policy="random")
    reg = records(("p0", "P"), ("p1", "P"), ("d0", "D"), ("d1", "D"))
    router = Router(reg)
    first, lease = router.plan(100, 8, [], [], prefix={CHUNK_TOKENS: h})
    lease.release()
    again = [router.plan(100, 8, [], [], prefix={CHUNK_TOKENS: h})[0] for _ in range(3)]
    assert {p.prefill.instance_id for p in again} == {first.prefill.instance_id}  # P follows the prefix
    assert {p.decode.instance_id for p in again} == {"d0", "d1"}  # D stays least-load


def test_router_forgets_instances_that_go_down_or_leave(pre, chunker):
    _, h = prepared(pre, chunker, chat("What is in this picture?"))
    reg = records(("c0", "EPD"), ("c1", "EPD"))
    router = Router(reg)
    for _ in range(2):
        router.plan(100, 8, [], [], prefix={CHUNK_TOKENS: h})[1].release()
        reg.get(router.index.instances()[0]).outstanding["PD"] = 10_000  # make the next one spill over
    assert router.index.instances() == ["c0", "c1"]
    for _ in range(reg.unhealthy_after):
        reg.record_failure("c0")
    reg.deregister("c1")
    assert router.index.instances() == []


def test_each_instance_is_matched_in_blocks_of_its_registered_size(pre, chunker):
    p2, _ = prepared(pre, chunker, chat("What is in this picture?", "Colours.", "Which colour most?"))
    ids, n = p2.prompt_token_ids, len(p2.prompt_token_ids)
    assert records(("a", "EPD")).get("a").block_size == CHUNK_TOKENS  # none registered: 16
    reg = records(("n0", "EPD"), ("n1", "EPD"), block_size=128)  # an NPU pool
    assert reg.get("n0").block_size == 128 and reg.get("n0").to_proto().block_size == 128
    router = Router(reg)
    prefix = chunker.by_block_size(ids, p2.media, [128])
    plan, lease = router.plan(n, 8, [], [], prefix=prefix)
    lease.release()
    again, lease = router.plan(n, 8, [], [], prefix=prefix)
    assert again.coupled.instance_id == plan.coupled.instance_id and again.prefix_tokens == n // 128 * 128 > 0
    lease.release()
    # hashes of another block size say nothing of this pool's caches
    other, lease = router.plan(n, 8, [], [], prefix=chunker.by_block_size(ids, p2.media, [16]))
    assert other.prefix_tokens == 0
