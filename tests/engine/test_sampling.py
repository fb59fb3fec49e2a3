"""Sampler and stop criteria: seeds, top-k/top-p, stop strings, stop token ids, EOS."""
import pytest

from epdserve import LLM, SamplingParams


@pytest.fixture(scope="module")
def llm(qwen2_vl_tiny):
    return LLM(model=qwen2_vl_tiny, device="cpu")


def _ids(llm, prompts, sp):
    return [o.outputs[0].token_ids for o in llm.generate(prompts, sp)]


def test_seeded_sampling_is_reproducible_regardless_of_batch(llm):
    sp = SamplingParams(max_tokens=12, temperature=1.0, seed=7, ignore_eos=True)
    alone = _ids(llm, ["sample me please"], sp)[0]
    batched = _ids(llm, ["other prompt", "sample me please", "third one here"], sp)[1]
    assert alone == batched
    different = _ids(llm, ["sample me please"], SamplingParams(max_tokens=12, temperature=1.0, seed=8, ignore_eos=True))[0]
    assert different != alone


def test_top_k_one_is_greedy(llm):
    greedy = _ids(llm, ["greedy check"], SamplingParams(max_tokens=8, ignore_eos=True))[0]
    topk = _ids(llm, ["greedy check"], SamplingParams(max_tokens=8, temperature=0.8, top_k=1, seed=1, ignore_eos=True))[0]
    tiny_p = _ids(llm, ["greedy check"], SamplingParams(max_tokens=8, temperature=0.8, top_p=1e-6, seed=1, ignore_eos=True))[0]
    assert topk == greedy == tiny_p


def test_stop_string_and_stop_token(llm):
    full = llm.generate("stop test", SamplingParams(max_tokens=12, ignore_eos=True))[0].outputs[0]
    stop_tok = full.token_ids[4]
    by_token = llm.generate("stop test", SamplingParams(max_tokens=12, ignore_eos=True, stop_token_ids=[stop_tok]))[0]
    first = full.token_ids.index(stop_tok)
    assert by_token.outputs[0].token_ids == full.token_ids[: first + 1]
    assert by_token.outputs[0].finish_reason == "stop"
    # a stop string from the second half of the text, not blank: the precondition is asserted, never skipped
    text = full.text
    stop_str = next((text[i:i + 3] for i in range(len(text) // 2, len(text) - 2) if text[i:i + 3].strip()), None)
    assert stop_str is not None and 0 < text.find(stop_str), f"no usable stop string in {text!r}"
    by_str = llm.generate("stop test", SamplingParams(max_tokens=12, ignore_eos=True, stop=[stop_str]))[0].outputs[0]
    assert by_str.finish_reason == "stop" and len(by_str.token_ids) < len(full.token_ids)
    assert by_str.text == text[: text.find(stop_str)]


def test_eos_stops_unless_ignored(llm):
    eos = llm.engine.tokenizer.convert_tokens_to_ids("<|im_end|>")
    sp = SamplingParams(max_tokens=10, ignore_eos=True)
    full = llm.generate("eos test", sp)[0].outputs[0].token_ids
    # make the third generated token count as EOS by passing it as the model's EOS id set
    llm.engine.model.eos_token_ids.add(full[2])
    try:
        out = llm.generate("eos test", SamplingParams(max_tokens=10))[0].outputs[0]
        assert out.token_ids == full[: full.index(full[2]) + 1] and out.finish_reason == "stop"
        kept = llm.generate("eos test", sp)[0].outputs[0]
        assert kept.token_ids == full
    finally:
        llm.engine.model.eos_token_ids.discard(full[2])
        llm.engine.model.eos_token_ids.add(eos)


def test_bad_params_are_rejected():
    for kw in ({"max_tokens": 0}, {"temperature": -1}, {"top_p": 0}, {"top_k": -2}, {"stop": [""]}):
        with pytest.raises(ValueError):
            SamplingParams(**kw)
