"""Identities no one can forge (issue 35), tried as an attacker would, offline (one engine, its
feature cache and prefix cache) and at the block manager; every launched mode does the same in
`tests/entrypoints/test_launch.py::test_forged_identities_get_their_own_answers`.

- A media pair built from XXH3's public secret (`xxh3_forge.colliding_ppms`: two valid 64x64
  images with one xxh3-128, the media key before issue 35) sent B then A: A gets A's own
  answer, transformers' greedy one. Before, A got B's features, prefix and answer.
- A first KV block forged against the old block hash (`xxh3_forge.forge_block`: 16 token ids
  whose xxh3-64 equals the first block of a chat, system prompt and all) sent before the chat:
  the chat gets its own answer. Before, it was answered from the forger's KV.
- A block registered under the digest of another block's content is a miss at the block manager,
  whatever the hash: a hit compares the content.
"""
from __future__ import annotations

import hashlib
import io
from array import array

import pytest
import xxhash
from PIL import Image

from epdserve.engine.block_manager import BlockManager
from epdserve.engine.prefix_hash import FIRST_PARENT, block_key
from epdserve.engine.sampling_params import SamplingParams
from epdserve.entrypoints.llm import LLM
from epdserve.model.chat import chat_to_prompt
from epdserve.model.reference import ReferenceGenerator
from epdserve.seams.media_keys import MediaKeySecret, media_key
from tests.security.xxh3_forge import colliding_ppms, old_block_hash
from tests.harness import PH

IMAGE_PROMPT = f"Describe {PH} in detail please, what do you see in this picture right now?"
CHAT = [{"role": "user", "content": [{"type": "text", "text": "Hello there, how are you today?"}]}]
MAX_TOKENS = 8
# The tiny demo tokenizer's first block of CHAT (its default system prompt and all), and a block
# `python -m tests.security.xxh3_forge <those 16 ids>` found with the same xxh3-64 (~30 s, 1 GB).
CHAT_BLOCK = [1993, 319, 198, 304, 296, 256, 320, 313, 13, 1994, 198, 1993, 317, 198, 39, 537]
FORGED_BLOCK = [147, 645, 394, 1506, 1915, 1178, 281, 1780, 1470, 1530, 1711, 443, 1851, 1892, 39, 537]


@pytest.fixture(scope="module")
def pair():
    return colliding_ppms()


@pytest.fixture(scope="module")
def ref(qwen2_vl_tiny):
    return ReferenceGenerator(qwen2_vl_tiny)


def forged_chat(tokenizer) -> tuple[str, list[int], list[int]]:
    """The chat's prompt, its token ids, and the forger's: the forged first block, then the same rest."""
    prompt = chat_to_prompt(tokenizer, CHAT, True)["prompt"]
    ids = tokenizer.encode(prompt, add_special_tokens=False)
    assert ids[:16] == CHAT_BLOCK, "the demo tokenizer changed: find FORGED_BLOCK again (see above)"
    return prompt, ids, FORGED_BLOCK + ids[16:]


def test_the_pair_is_two_valid_images_with_one_old_key_and_two_new_ones(pair):
    a, b = pair
    assert a != b and sum(x != y for x, y in zip(a, b)) > 5000
    for raw in pair:
        assert Image.open(io.BytesIO(raw)).convert("RGB").size == (64, 64)
    assert xxhash.xxh3_128_hexdigest(a) == xxhash.xxh3_128_hexdigest(b)  # the attack is real
    secret = MediaKeySecret.random()
    assert media_key(a, "ns", secret) != media_key(b, "ns", secret)


def test_the_forged_block_collides_under_the_old_block_hash():
    assert FORGED_BLOCK != CHAT_BLOCK and old_block_hash(FORGED_BLOCK) == old_block_hash(CHAT_BLOCK)
    forged, chat = (block_key(FIRST_PARENT, array("q", ids).tobytes()) for ids in (FORGED_BLOCK, CHAT_BLOCK))
    assert forged.digest != chat.digest  # under the block hash the engine uses, no collision


def test_the_block_hash_is_sha256_and_the_media_key_keyed_blake2b():
    """The hashes themselves, pinned by known answers: a block's digest is SHA-256 of its content
    (a fast unkeyed hash such as xxh3-64 is what FORGED_BLOCK collides under), a media key is
    BLAKE2b-128 keyed by the deployment secret (an unkeyed or public-secret hash lets anyone aim
    two images at one key)."""
    ids = bytes(range(128))  # one block of 16 int64 token ids
    first = block_key(FIRST_PARENT, ids)
    assert first.content == FIRST_PARENT + ids
    assert first.digest == hashlib.sha256(FIRST_PARENT + ids).digest()
    assert first.digest.hex() == "b68b7a862ea33e58fdfdf197c204a68ca3695473efdd111b09120f0f5bd7ae9e"
    assert block_key(first.digest, ids).digest == hashlib.sha256(first.digest + ids).digest()  # chained
    secret = MediaKeySecret("a pinned test secret")
    key = hashlib.blake2b(b"a pinned test secret", digest_size=32, person=b"epdserve-mkey").digest()
    want = hashlib.blake2b(b"image bytes", digest_size=16, key=key, person=b"epdserve-media").hexdigest()
    assert media_key(b"image bytes", "ns", secret) == "ns:" + want == "ns:96f3ae4762cc52b5cb7eeaea0cbb901d"
    assert MediaKeySecret("another secret").digest(b"image bytes") != want  # the key is the secret's
    assert secret.digest(b"image bytes", "tenant") == "0ff978c309038aa94507545bf3acf8e1"


def test_offline_b_then_a_gets_a_its_own_answer(qwen2_vl_tiny, pair, ref):
    a, b = pair
    want_a, want_b = (ref.generate(IMAGE_PROMPT, [x], MAX_TOKENS) for x in (a, b))
    assert want_a != want_b  # the pair answers differently: serving one for the other shows
    llm = LLM(str(qwen2_vl_tiny), device="cpu")
    sp = SamplingParams(max_tokens=MAX_TOKENS, ignore_eos=True)
    got_b = llm.generate({"prompt": IMAGE_PROMPT, "multi_modal_data": {"image": [b]}}, sp)[0].outputs[0].token_ids
    got_a = llm.generate({"prompt": IMAGE_PROMPT, "multi_modal_data": {"image": [a]}}, sp)[0].outputs[0].token_ids
    assert (got_b, got_a) == (want_b, want_a)


def test_offline_a_block_forged_against_the_old_hash_is_not_served(qwen2_vl_tiny, ref):
    llm = LLM(str(qwen2_vl_tiny), device="cpu")
    prompt, ids, forged = forged_chat(llm.get_tokenizer())
    sp = SamplingParams(max_tokens=MAX_TOKENS, ignore_eos=True)
    llm.generate([forged], sp)  # the forger's prompt first: its blocks go to the prefix cache
    out = llm.generate([ids], sp)[0]
    assert out.outputs[0].token_ids == ref.generate(prompt, [], MAX_TOKENS)


def test_a_block_under_the_digest_of_other_content_is_a_miss():
    bm = BlockManager(num_blocks=4, block_size=16, prefix_caching=True)
    victim = block_key(FIRST_PARENT, bytes(8 * 16))
    forged = victim._replace(content=block_key(FIRST_PARENT, b"\1" * (8 * 16)).content)  # a collision by fiat
    bm.grow("forger", 16)
    bm.cache("forger", [forged])
    bm.free("forger")
    assert bm.num_cached == 1 and bm.lookup([victim]) == [] and bm.mismatches == 1
    fresh = BlockManager(num_blocks=4, block_size=16, prefix_caching=True)
    fresh.grow("owner", 16)
    fresh.cache("owner", [victim])
    assert fresh.lookup([victim]) == list(fresh.table("owner")[:1])  # the genuine block is a hit
