"""Per-item E→P pipelining (engine/pipelined_prefill.py) on a real prefill-side engine: with a
3-image prompt whose features arrive in every order, the prompt is prefilled up to the first
image still missing before the others land (the text ahead of it is in the KV cache while the
rest still "encode"), the request's `prefill_start` comes before its `encode_end`, and greedy
tokens equal transformers' in every order. An item recomputed here (nothing on its way) while
the others come from the store keeps the output exact; `pipelined_prefill=False` keeps today's
order (nothing prefilled before every item is in)."""
import itertools

import pytest

from epdserve import SamplingParams
from epdserve.engine.config import EngineConfig
from epdserve.engine.llm_engine import LLMEngine
from epdserve.model.demo_images import jpeg_bytes, procedural_image
from epdserve.model.reference import ReferenceGenerator
from epdserve.seams.feature_provider import LocalFeatureProvider
from tests.harness import PH

SP = SamplingParams(max_tokens=8, ignore_eos=True)
PROMPT = f"first look at this {PH} then at that one {PH} and finally {PH}; compare all three"


@pytest.fixture(scope="module", params=["qwen2_vl", "qwen3_vl"])
def setup(request):
    model = request.getfixturevalue(f"{request.param}_tiny")
    imgs = [jpeg_bytes(procedural_image(w, h, s)) for w, h, s in ((112, 84, 31), (56, 140, 32), (84, 84, 33))]
    src = LocalFeatureProvider()
    enc = LLMEngine(EngineConfig(model=str(model), device="cpu", roles="E"), features=src)
    req = enc.build_request("src", PROMPT, imgs, SP)
    enc.add_request(type(req)("src", [], req.media, SP))
    while enc.has_unfinished():
        enc.step()
    features = {m.key: src.load(m.key) for m in req.media}
    assert all(f is not None for f in features.values())
    expected = ReferenceGenerator(model).generate(PROMPT, imgs, SP.max_tokens)
    return model, imgs, features, expected


def _prefill_engine(model, store, **kw):
    return LLMEngine(EngineConfig(model=str(model), device="cpu", roles="PD", feature_wait_s=3600.0,
                                  enable_prefix_caching=False, **kw), features=store)


def _run(eng, rid, idle_steps=3):
    """Step until nothing changes for `idle_steps` steps or the request finished; its output if it did."""
    for _ in range(idle_steps):
        for o in eng.step():
            if o.request_id == rid and o.finished:
                return o
    return None


def _first_visual(eng, seq, j):
    return seq.pipeline.visual[seq.pipeline.offsets[j]] if seq.pipeline else seq.prompt_len


def test_every_arrival_order_prefills_ahead_and_is_exact(setup):
    model, imgs, features, expected = setup
    store = LocalFeatureProvider()
    eng = _prefill_engine(model, store)
    for n, order in enumerate(itertools.permutations(range(3))):
        rid = f"order-{n}"
        req = eng.build_request(rid, PROMPT, imgs, SP)
        keys = [m.key for m in req.media]
        eng.add_request(req)
        seq = eng._seqs[rid]
        starts = [_first_visual(eng, seq, j) for j in range(3)]
        assert _run(eng, rid) is None
        assert seq.num_computed_tokens == starts[0] > 0  # the text ahead of image 1, nothing more
        arrived = set()
        out = None
        for k in order:
            store.save(keys[k], features[keys[k]])
            arrived.add(k)
            out = _run(eng, rid)
            if len(arrived) < 3:
                missing = min(j for j in range(3) if j not in arrived)
                assert out is None and seq.num_computed_tokens == starts[missing], (order, k)
        while out is None:
            out = _run(eng, rid, 1)
        assert out.error is None and out.token_ids == expected, order
        assert out.timings["prefill_start"] < out.timings["encode_end"], order
        assert out.num_cached_vision_tokens == out.num_vision_tokens
        for key in keys:
            store.drop(key)
    assert eng.load_report()["recomputes"] == 0


def test_an_item_recomputed_here_while_the_others_come_from_the_store(setup):
    model, imgs, features, expected = setup
    store = LocalFeatureProvider()
    eng = _prefill_engine(model, store)
    req = eng.build_request("r", PROMPT, imgs, SP)
    req.media[1].wait_since = float("-inf")  # nothing on its way (its E died): recompute at once
    eng.add_request(req)
    seq = eng._seqs["r"]
    assert _run(eng, "r") is None
    assert eng.load_report()["recomputes"] == 1 and seq.media[1].features is not None
    assert seq.num_computed_tokens == _first_visual(eng, seq, 0)
    for j in (2, 0):
        store.save(req.media[j].key, features[req.media[j].key])
    out = None
    while out is None:
        out = _run(eng, "r", 1)
    assert out.error is None and out.token_ids == expected


def test_without_pipelining_nothing_is_prefilled_before_every_item_is_in(setup):
    model, imgs, features, expected = setup
    store = LocalFeatureProvider()
    eng = _prefill_engine(model, store, pipelined_prefill=False)
    req = eng.build_request("r", PROMPT, imgs, SP)
    eng.add_request(req)
    seq = eng._seqs["r"]
    for m in req.media[:2]:
        store.save(m.key, features[m.key])
    assert _run(eng, "r") is None and seq.num_computed_tokens == 0
    store.save(req.media[2].key, features[req.media[2].key])
    out = None
    while out is None:
        out = _run(eng, "r", 1)
    assert out.token_ids == expected and out.timings["prefill_start"] >= out.timings["encode_end"]
