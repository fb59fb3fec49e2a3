"""min_p (vLLM's definition) in the sampler: tokens whose probability (after temperature) is below
min_p times the top token's are dropped before the draw; greedy ignores it. Checked against a
direct torch computation drawing with an identically seeded generator, and end to end through
the engine (`LLM`)."""
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from epdserve import LLM, SamplingParams
from epdserve.engine.sampler import filtered_logits, sample


def _reference_probs(row: torch.Tensor, temperature: float, min_p: float, top_p: float = 1.0) -> torch.Tensor:
    """The distribution vLLM samples from: softmax(row / T), min-p mask, renormalise, then top-p."""
    probs = torch.softmax(row / temperature, dim=-1)
    probs = torch.where(probs >= min_p * probs.max(), probs, torch.zeros_like(probs))
    probs = probs / probs.sum()
    if top_p < 1.0:
        sorted_p, idx = torch.sort(probs, descending=True)
        before = sorted_p.cumsum(-1) - sorted_p  # mass of the tokens ranked above each one
        sorted_p = torch.where(before < top_p, sorted_p, torch.zeros_like(sorted_p))
        probs = torch.zeros_like(probs).scatter(0, idx, sorted_p)
        probs = probs / probs.sum()
    return probs


def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


@settings(max_examples=40, deadline=None, derandomize=True)
@given(seed=st.integers(0, 2**31 - 1), min_p=st.floats(0.01, 1.0), temperature=st.floats(0.3, 2.0),
       top_p=st.sampled_from([1.0, 0.9, 0.5]))
def test_sampler_matches_a_direct_torch_computation(seed, min_p, temperature, top_p):
    row = torch.randn(257, generator=_gen(seed)) * 3
    want = _reference_probs(row, temperature, min_p, top_p)
    p = SamplingParams(temperature=temperature, min_p=min_p, top_p=top_p)
    got = torch.softmax(filtered_logits(row, p), dim=-1)
    assert torch.equal(got > 0, want > 0)  # the same tokens kept
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-7)
    drawn = sample(row[None], [p], [_gen(seed + 1)])[0]
    assert drawn == int(torch.multinomial(want, 1, generator=_gen(seed + 1)).item())
    assert want[drawn] > 0


def test_min_p_drops_exactly_the_tokens_below_the_threshold():
    probs = torch.tensor([0.5, 0.2, 0.15, 0.1, 0.05])
    p = SamplingParams(temperature=1.0, min_p=0.3)  # threshold 0.15: 0.1 and 0.05 go, 0.15 stays
    kept = torch.isfinite(filtered_logits(probs.log(), p))
    assert kept.tolist() == [True, True, True, False, False]
    draws = {sample(probs.log()[None], [p], [_gen(s)])[0] for s in range(200)}
    assert draws == {0, 1, 2}


def test_greedy_ignores_min_p_and_min_p_zero_filters_nothing():
    row = torch.randn(64, generator=_gen(3))
    assert sample(row[None], [SamplingParams(temperature=0.0, min_p=0.9)], [None]) == [int(row.argmax())]
    assert torch.equal(filtered_logits(row, SamplingParams(temperature=0.7, min_p=0.0)), row / 0.7)


def test_min_p_outside_0_1_is_refused():
    for bad in (-0.1, 1.5):
        with pytest.raises(ValueError, match="min_p"):
            SamplingParams(min_p=bad)


def test_min_p_one_through_the_engine_is_greedy(qwen2_vl_tiny):
    llm = LLM(model=qwen2_vl_tiny, device="cpu")
    prompt = ["min p check"]
    greedy = llm.generate(prompt, SamplingParams(max_tokens=8, ignore_eos=True))[0].outputs[0].token_ids
    free = llm.generate(prompt, SamplingParams(max_tokens=8, temperature=1.0, seed=5, ignore_eos=True))
    only_top = llm.generate(prompt, SamplingParams(max_tokens=8, temperature=1.0, seed=5, min_p=1.0, ignore_eos=True))
    assert free[0].outputs[0].token_ids != greedy  # sampling without min_p wanders off greedy ...
    assert only_top[0].outputs[0].token_ids == greedy  # ... min_p=1 keeps only the top token
