"""The prefix cache's query/hit totals (`Scheduler.prefix_queried_tokens` / `prefix_hit_tokens`,
in `LLMEngine.load_report()`): each request counts once, at its first admission — its prompt
queried, its cached tokens hit — however often it was looked up before (at add for its media,
again at admission); they agree with the outputs' `num_cached_tokens`."""
from epdserve.engine.config import EngineConfig
from epdserve.engine.llm_engine import LLMEngine
from epdserve.engine.sampling_params import SamplingParams
from epdserve.model.demo_images import jpeg_bytes, procedural_image
from tests.harness import PH


def _run(eng, rid, prompt, images):
    eng.add_request(eng.build_request(rid, prompt, images, SamplingParams(max_tokens=3, ignore_eos=True)))
    outs = [o for _ in range(200) if eng.has_unfinished() for o in eng.step() if o.finished]
    return outs[-1]


def test_each_request_counts_once(qwen2_vl_tiny):
    eng = LLMEngine(EngineConfig(model=str(qwen2_vl_tiny), device="cpu"))
    img = jpeg_bytes(procedural_image(112, 84, 3))
    turn = f"user: look {PH} and tell me what it is, in a few careful words please. "
    first = _run(eng, "a", turn, [img])
    rep = eng.load_report()
    assert (rep["prefix_queried_tokens"], rep["prefix_hit_tokens"]) == (first.num_prompt_tokens, 0)
    second = _run(eng, "b", turn + "and again? ", [img])
    third = _run(eng, "c", "plain text that shares nothing with the others at all", [])
    rep = eng.load_report()
    assert second.num_cached_tokens > 0 and third.num_cached_tokens == 0
    assert rep["prefix_queried_tokens"] == sum(o.num_prompt_tokens for o in (first, second, third))
    assert rep["prefix_hit_tokens"] == second.num_cached_tokens


def test_off_counts_nothing(qwen2_vl_tiny):
    eng = LLMEngine(EngineConfig(model=str(qwen2_vl_tiny), device="cpu", enable_prefix_caching=False))
    for rid in "ab":
        assert _run(eng, rid, "the same words twice over, long enough for a block or two of them", []).num_cached_tokens == 0
    rep = eng.load_report()
    assert (rep["prefix_queried_tokens"], rep["prefix_hit_tokens"]) == (0, 0)
