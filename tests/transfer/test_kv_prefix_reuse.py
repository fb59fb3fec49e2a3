"""D keeps the KV it imported as a prefix cache, and P sends only the blocks D lacks (issue 28
item 3): a prefill-only and a decode-only engine in one process, joined by the layerwise
connectors over a real gloo pair on loopback, run a two-turn conversation over one image.

Turn 2 re-sends turn 1, its answer and a new question: D finds turn 1's blocks (imported, and
its own decoded answer) in its cache, reserves only the rest, and P's sender moves only those
blocks. Greedy tokens equal transformers' generate with D's cache on and off; a cache that lost
the blocks (or a D without the media's identity) falls back to a full transfer.
"""
from __future__ import annotations

import pytest

from epdserve import SamplingParams
from epdserve.bench.kv_prefix_reuse import PH, PDPair
from epdserve.model.demo_images import jpeg_bytes, procedural_image
from epdserve.model.reference import ReferenceGenerator
from tests.engine.blocks import all_blocks_free

SP = SamplingParams(max_tokens=8, ignore_eos=True)
TURN1 = f"user: look at {PH} and tell me what it is. " + "Some more words to fill a few blocks. " * 4


class PD(PDPair):
    def __init__(self, model_dir, d_cache: bool = True, d_blocks: int | None = None):
        super().__init__(model_dir, d_cache, None if d_blocks is None else d_blocks * 8192)  # the tiny demo's block

    def turn(self, rid, prompt, images, identity=True):
        return super().turn(rid, prompt, images, SP, identity)

    def idle(self) -> bool:
        return all_blocks_free(self.p) and all_blocks_free(self.d) and not any(self.d.scheduler._blocks._refs)


@pytest.fixture(scope="module")
def image():
    return jpeg_bytes(procedural_image(112, 84, 5))


@pytest.mark.parametrize("d_cache", [True, False])
def test_second_turn_sends_only_its_new_blocks(qwen2_5_vl_tiny, image, d_cache):
    ref = ReferenceGenerator(qwen2_5_vl_tiny)
    pd = PD(qwen2_5_vl_tiny, d_cache=d_cache)
    try:
        bs, block_bytes = pd.p.kv_cache.spec.block_size, pd.p.kv_cache.spec.bytes_per_block()
        first, cached1, sent1 = pd.turn("t1", TURN1, [image])
        turn2 = TURN1 + pd.p.tokenizer.decode(first.token_ids) + " user: and what colour is it? "
        second, cached2, sent2 = pd.turn("t2", turn2, [image])
        n1, n2 = first.num_prompt_tokens, second.num_prompt_tokens
        assert first.token_ids == ref.generate(TURN1, [image], SP.max_tokens)
        assert second.token_ids == ref.generate(turn2, [image], SP.max_tokens)
        assert cached1 == 0 and sent1 == -(-n1 // bs) * block_bytes  # a first turn moves every block
        if d_cache:
            assert cached2 >= (n1 // bs) * bs  # at least turn 1's full blocks stayed on D
            assert sent2 == (-(-n2 // bs) - cached2 // bs) * block_bytes  # only the blocks D lacked travelled
            assert pd.tx.counters.bytes_skipped == pd.rx.counters.bytes_skipped == cached2 // bs * block_bytes
            assert sent2 <= 0.5 * (-(-n2 // bs)) * block_bytes
        else:
            assert cached2 == 0 and sent2 == -(-n2 // bs) * block_bytes
        assert pd.rx.counters.bytes == pd.tx.counters.bytes
        assert pd.idle()
    finally:
        pd.close()


def test_another_image_or_no_identity_imports_everything_past_the_text(qwen2_5_vl_tiny, image):
    """The same text over another image shares only the blocks before the image; a D not told the
    media's identity caches nothing of a prompt with media (it could not tell two images apart)."""
    other = jpeg_bytes(procedural_image(112, 84, 6))
    ref = ReferenceGenerator(qwen2_5_vl_tiny)
    pd = PD(qwen2_5_vl_tiny)
    try:
        pd.turn("a", TURN1, [image])
        req = pd.p.build_request("x", TURN1, [other])
        first_image_token = req.prompt_token_ids.index(pd.p.model.adapter.image_token_id)
        out, cached, _ = pd.turn("b", TURN1, [other])
        assert cached <= first_image_token and out.token_ids == ref.generate(TURN1, [other], SP.max_tokens)
        _, cached, _ = pd.turn("c", TURN1, [image], identity=False)
        _, again, _ = pd.turn("d", TURN1, [image], identity=False)
        assert cached <= first_image_token and again <= first_image_token
        assert pd.idle()
    finally:
        pd.close()


def test_evicted_blocks_fall_back_to_a_full_transfer(qwen2_5_vl_tiny, image):
    """D's cache too small to keep turn 1 while other requests ran: turn 2 imports everything."""
    ref = ReferenceGenerator(qwen2_5_vl_tiny)
    pd = PD(qwen2_5_vl_tiny, d_blocks=12)
    try:
        bs, block_bytes = pd.p.kv_cache.spec.block_size, pd.p.kv_cache.spec.bytes_per_block()
        first, _, _ = pd.turn("t1", TURN1, [image])
        for i in range(2):  # other conversations take D's blocks back
            pd.turn(f"other{i}", f"something else entirely, number {i}. " * 6, [])
        assert pd.d.scheduler._blocks.evictions > 0
        turn2 = TURN1 + "user: again? "
        out, cached, sent = pd.turn("t2", turn2, [image])
        assert cached < first.num_prompt_tokens // bs * bs  # turn 1's blocks were (partly) evicted
        assert sent == (-(-out.num_prompt_tokens // bs) - cached // bs) * block_bytes
        assert out.token_ids == ref.generate(turn2, [image], SP.max_tokens)
        assert pd.idle()
    finally:
        pd.close()
