"""Encode and prefill as two engine stages that exchange features only through the MM Store.

The encode stage is an `LLMEngine` with roles "E" (a request with a `feature_target`) and an encode-side
provider (put + event to the prefill instance); the prefill stage is an engine with roles "PD"
whose provider prefetches from its event stream. Outputs are checked against transformers'
`generate`; the encoder's work is read from the engines' counters.
"""
import inspect
import logging
import uuid

import pytest

from epdserve import SamplingParams
from epdserve.engine.config import EngineConfig
from epdserve.seams.feature_provider import FeatureProvider
from epdserve.engine.llm_engine import LLMEngine
from epdserve.model.demo_images import jpeg_bytes, procedural_image
from epdserve.model.reference import ReferenceGenerator
from epdserve.transfer.mm_store import LocalRedisServer, RedisConnection, RedisMMStore
from epdserve.seams.media_keys import MediaKeySecret, media_key
from epdserve.transfer.mm_store.provider import MMStoreFeatureProvider
from tests.harness import PH

SP = SamplingParams(max_tokens=6, ignore_eos=True)


class SteppedClock:
    def __init__(self):
        self.now = 1000.0

    def __call__(self):
        return self.now


@pytest.fixture(scope="module")
def reference(qwen2_5_vl_tiny):
    return ReferenceGenerator(qwen2_5_vl_tiny)


def _image(seed):
    return jpeg_bytes(procedural_image(112, 84, seed))


class Stages:
    """An E engine and a P(D) engine wired through one store; one process, like one deployment."""

    def __init__(self, model_dir, store):
        self.target = f"p-{uuid.uuid4().hex[:8]}"
        self.e_prov = MMStoreFeatureProvider(store, "E", default_target=self.target)
        self.p_prov = MMStoreFeatureProvider(store, "PD", instance_id=self.target)
        self.e = LLMEngine(EngineConfig(model=str(model_dir), device="cpu", roles="E"), features=self.e_prov)
        # E's encode is over before P gets the request: a feature P does not find is gone, recompute at once
        self.p = LLMEngine(EngineConfig(model=str(model_dir), device="cpu", roles="PD", feature_wait_s=0.0),
                           features=self.p_prov)
        assert self.e.model.namespace == self.p.model.namespace

    def encode(self, rid, prompt, images):
        req = self.e.build_request(rid, prompt, images)
        req.feature_target = self.target
        self.e.add_request(req)
        (done,) = [o for o in _drain(self.e) if o.finished]
        assert done.error is None and done.finish_reason is None, done.error  # handed off to prefill

    def prefill_decode(self, rid, prompt, images):
        self.p.add_request(self.p.build_request(rid, prompt, images, SP))
        (final,) = [o for o in _drain(self.p) if o.finished]
        assert final.error is None, final.error
        return final

    def key(self, image):
        return media_key(image, self.e.model.namespace, self.e.model.media_secret)

    def close(self):
        self.p_prov.close()
        self.e_prov.close()


def _drain(eng):
    outs = []
    while eng.has_unfinished():
        outs.extend(eng.step())
    return outs


def test_provider_implements_the_engine_interface():
    assert issubclass(MMStoreFeatureProvider, FeatureProvider)
    abstract = {n for n in dir(FeatureProvider) if getattr(getattr(FeatureProvider, n), "__isabstractmethod__", False)}
    for name in abstract | {"stats", "close"}:
        ours = inspect.signature(getattr(MMStoreFeatureProvider, name))
        theirs = inspect.signature(getattr(FeatureProvider, name))
        assert list(ours.parameters) == list(theirs.parameters), name


def test_prefetched_feature_is_local_before_prefill_and_repeats_skip_the_encoder(qwen2_5_vl_tiny, reference):
    with LocalRedisServer() as server:
        store = RedisMMStore(server.url)
        st = Stages(qwen2_5_vl_tiny, store)
        img = _image(1)
        prompts = [f"describe {PH} please", f"what is in {PH}?"]
        try:
            st.encode("r1", prompts[0], [img])
            # The scheduler hop E -> P: by the time P gets the request the event has been acted on.
            assert st.p_prov.cache.wait_for(st.key(img), timeout_s=30) is not None
            before = st.p_prov.stats()
            assert before.prefetches == 1 and before.hits_local == 0
            out1 = st.prefill_decode("r1", prompts[0], [img])

            st.encode("r2", prompts[1], [img])  # the same image again
            out2 = st.prefill_decode("r2", prompts[1], [img])
        finally:
            st.close()
            store.close()
    assert out1.token_ids == reference.generate(prompts[0], [img], SP.max_tokens)
    assert out2.token_ids == reference.generate(prompts[1], [img], SP.max_tokens)
    assert st.e.encoder.encoder_runs == 1  # r2's image was not encoded again
    assert st.p.encoder.encoder_runs == 0 and st.p.encoder.recomputes == 0  # prefill never encoded
    p = st.p_prov.stats()
    assert p.hits_local == 2 and p.hits_store == 0 and p.waits == 0 and p.misses == 0
    assert out1.num_cached_vision_tokens == out1.num_vision_tokens > 0
    e = st.e_prov.stats()
    assert e.saves == 1 and e.events_published == 1


def test_key_deleted_between_encode_and_prefill_is_recomputed(qwen2_5_vl_tiny, reference):
    with LocalRedisServer() as server:
        store = RedisMMStore(server.url)
        st = Stages(qwen2_5_vl_tiny, store)
        st.p_prov.listener.stop()  # P is not listening yet: the deletion wins the race
        img, prompt = _image(2), f"{PH} tell me"
        try:
            st.encode("r1", prompt, [img])
            assert store.delete(st.key(img))
            out = st.prefill_decode("r1", prompt, [img])
        finally:
            st.close()
            store.close()
    assert out.token_ids == reference.generate(prompt, [img], SP.max_tokens)
    assert st.p.encoder.recomputes == 1
    p = st.p_prov.stats()
    assert p.misses >= 1 and p.hits_local == 0 and p.hits_store == 0


@pytest.mark.timeout(300)
def test_server_stopped_mid_run_recomputes_with_one_warning_then_recovers(qwen2_5_vl_tiny, reference, caplog):
    caplog.set_level(logging.INFO, logger="epdserve.transfer.mm_store")
    clock = SteppedClock()
    with LocalRedisServer() as server:
        conn = RedisConnection(server.url, backoff_s=5.0, max_backoff_s=5.0, clock=clock)
        store = RedisMMStore(server.url, connection=conn)
        st = Stages(qwen2_5_vl_tiny, store)
        imgs = [_image(10 + i) for i in range(5)]
        prompts = [f"image {i}: {PH}" for i in range(5)]
        outs = {}
        try:
            st.encode("r0", prompts[0], [imgs[0]])
            assert st.p_prov.cache.wait_for(st.key(imgs[0]), 30) is not None
            outs[0] = st.prefill_decode("r0", prompts[0], [imgs[0]])

            server.stop()
            for i in (1, 2, 3):
                st.encode(f"r{i}", prompts[i], [imgs[i]])
                outs[i] = st.prefill_decode(f"r{i}", prompts[i], [imgs[i]])
            down = st.e_prov.stats()
            recomputed_while_down = st.p.encoder.recomputes

            server.start()  # same port
            clock.now += 5.0
            assert conn.health.wait_up(30)  # the listener's next read probes and finds it back
            st.encode("r4", prompts[4], [imgs[4]])
            assert st.p_prov.cache.wait_for(st.key(imgs[4]), 30) is not None
            outs[4] = st.prefill_decode("r4", prompts[4], [imgs[4]])
        finally:
            st.close()
            store.close()
    for i, out in outs.items():
        assert out.token_ids == reference.generate(prompts[i], [imgs[i]], SP.max_tokens), i
    assert recomputed_while_down == 3 and down.save_failures == 3 and down.saves == 1
    assert st.p.encoder.recomputes == 3  # r4 went through the store again
    after = st.p_prov.stats()
    assert after.prefetches == 2 and after.hits_local == 2
    warnings = [r for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1 and "unreachable" in warnings[0].getMessage()
    assert sum("reachable again" in r.getMessage() for r in caplog.records) == 1
