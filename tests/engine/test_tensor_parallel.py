"""Tensor parallelism inside an instance (engine/tp/, issue 47 item 2), its ranks processes over
gloo on loopback: greedy outputs at TP2 (Qwen2-VL; Qwen3-VL, DeepStack included) and at TP4
(Qwen2.5-VL, whose 2 KV heads are each held by two ranks) equal transformers' `generate` token for
token on one mixed batch of text, images and a video (a part at a near tie of transformers' own
logits would be printed, not hidden); Qwen3-VL-MoE at TP2 splits its experts over the ranks
(expert parallelism) and equals transformers too; every rank encodes a share of the media
(the vision encoder data-parallel over the ranks); a degree that does not split the model (its
heads, MLP or experts) is refused at start-up; a rank killed mid-run ends the engine with RankFailure, never half a
model serving."""
from __future__ import annotations

import pytest

from epdserve import LLM, SamplingParams
from epdserve.engine.tp.group import RankFailure
from epdserve.engine.tp.shard import check_degree, head_map, TPShard, valid_degrees
from epdserve.model.demo_images import jpeg_bytes, procedural_image
from tests.engine.blocks import all_blocks_free
from tests.engine.test_video import _checked_cases
from tests.harness import PH
from tests.hf_oracle import HFOracle, assert_same_greedy

TOKENS = 10
KV_CACHE_BYTES = 32 << 20  # per rank (the default 1 GiB, held by four engines and their ranks, is 8 GiB)
PROMPTS = [
    ("the quick brown fox jumps over the lazy dog", []),
    (f"what is in {PH} here", [jpeg_bytes(procedural_image(112, 84, 1))]),
    (f"a {PH} b {PH} c {PH} compare them", [jpeg_bytes(procedural_image(w, h, s))
                                            for w, h, s in ((100, 76, 2), (56, 140, 3), (171, 113, 4))]),
]
DEGREES = [("qwen2_vl", 2), ("qwen3_vl", 2), ("qwen3_vl_moe", 2), ("qwen2_5_vl", 4)]
_llms: dict = {}  # (arch, tp) -> LLM, shared by this module's tests, closed at its end


@pytest.fixture(scope="module", autouse=True)
def _close_llms():
    yield
    for llm in _llms.values():
        llm.engine.close()
    _llms.clear()  # their KV caches go with them, not at the worker's end


def _llm(request, arch: str, tp: int) -> LLM:
    if (arch, tp) not in _llms:
        _llms[arch, tp] = LLM(model=request.getfixturevalue(f"{arch}_tiny"), device="cpu", tensor_parallel_size=tp,
                              kv_cache_bytes=KV_CACHE_BYTES)
    return _llms[arch, tp]


@pytest.mark.parametrize("arch, tp", DEGREES, ids=[f"{a}-tp{t}" for a, t in DEGREES])
def test_greedy_outputs_equal_transformers(request, arch, tp):
    model_dir = request.getfixturevalue(f"{arch}_tiny")
    llm = _llm(request, arch, tp)
    lm, a = llm.engine.model.lm, llm.engine.model.adapter
    q, kv = head_map(a.num_heads, a.num_kv_heads, TPShard(0, tp))
    assert (lm.num_heads, lm.num_kv_heads) == (len(q), len(kv)) == (a.num_heads // tp, max(1, a.num_kv_heads // tp))
    assert llm.engine.kv_cache.spec.num_kv_heads == len(kv)  # rank 0's cache holds its own KV heads only
    videos = _checked_cases(model_dir, arch)
    inputs = [{"prompt": p, "multi_modal_data": {"image": imgs}} if imgs else p for p, imgs in PROMPTS]
    outs = llm.generate(inputs + [v for v, _ in videos], SamplingParams(max_tokens=TOKENS, ignore_eos=True))
    assert all(o.error is None for o in outs)
    oracle = HFOracle(model_dir)
    for (prompt, imgs), out in zip(PROMPTS, outs):
        want, margins = oracle.generate_with_margins(prompt, imgs, TOKENS)
        assert_same_greedy(out.outputs[0].token_ids, want, margins, f"{arch} TP{tp} {prompt!r}")
    for (_, rec), out in zip(videos, outs[len(PROMPTS):]):  # transformers' own video pipeline's tokens
        assert out.outputs[0].token_ids == rec["greedy_tokens"], rec["video_file"]
    assert all_blocks_free(llm.engine)
    by_rank = llm.engine.encoder.encode.items_by_rank  # the encoder ran data-parallel over the ranks
    assert len(by_rank) == tp and all(n > 0 for n in by_rank), by_rank


def test_the_group_listens_on_loopback_only(request):
    import psutil

    llm = _llm(request, "qwen2_vl", 2)
    store_port = llm.engine.tp._store.port
    listening = {(c.laddr.ip, c.laddr.port) for c in psutil.Process().net_connections("inet")
                 if c.status == psutil.CONN_LISTEN}
    assert ("127.0.0.1", store_port) in listening, listening  # the rendezvous store, on loopback
    assert {ip for ip, _ in listening} <= {"127.0.0.1", "::ffff:127.0.0.1"}, listening


def test_a_killed_rank_ends_the_engine_with_rank_failure(request):
    llm = _llm(request, "qwen2_5_vl", 4)
    rank = llm.engine.tp._procs[1]  # rank 2
    rank.kill()
    rank.wait()
    with pytest.raises(RankFailure, match="rank"):
        llm.generate(["one more"], SamplingParams(max_tokens=4, ignore_eos=True))


def test_a_degree_that_does_not_split_the_model_is_refused_with_the_valid_ones():
    assert valid_degrees(4, 2, 128) == [1, 2, 4]
    assert valid_degrees(28, 4, 18944) == [1, 2, 4]  # Qwen2-VL-7B's shapes: 28 heads, 4 KV heads
    with pytest.raises(ValueError, match=r"tensor_parallel_size=3 .*4 attention heads, 2 KV heads.*valid degrees: 1, 2, 4"):
        check_degree(3, 4, 2, 128)


def test_experts_must_split_too_and_each_rank_holds_its_own(request):
    assert valid_degrees(4, 2, 128, num_experts=6) == [1, 2]
    with pytest.raises(ValueError, match=r"tensor_parallel_size=4 .*6 experts\); valid degrees: 1, 2"):
        check_degree(4, 4, 2, 128, num_experts=6)
    llm = _llm(request, "qwen3_vl_moe", 2)
    sparse = [w.moe for w in llm.engine.model.lm.layers if w.moe is not None]
    assert sparse and all((m.first, m.num_local, m.router.shape[0]) == (0, 4, 8) for m in sparse)  # rank 0: experts 0-3
