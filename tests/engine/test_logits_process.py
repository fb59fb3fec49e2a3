"""Logits processors and log probabilities in the engine (offline `LLM`): the row processing
matches vLLM's formulas computed directly; sampled logprobs are the raw ones (vLLM's default
`raw_logprobs`: transformers' teacher-forced log_softmax, whatever the temperature and
penalties); a request resumed after k of its tokens (`resumed_outputs=k`) counts them as output
and continues exactly as the whole request did; bad values are refused by name."""
import pytest
import torch

from epdserve import LLM, SamplingParams
from epdserve.engine.logits_process import process_row
from epdserve.model.loader import load_checkpoint

PROMPT = [11, 52, 93, 52, 11, 7, 300, 52, 18, 44]


def _direct(row, prompt, output, rep, pres, freq, bias):
    """vLLM v1: bias, then repetition over prompt and output, then frequency/presence over output."""
    row = row.clone()
    for t, b in bias.items():
        row[t] += b
    seen = set(prompt) | set(output)
    for t in seen:
        row[t] = row[t] / rep if row[t] > 0 else row[t] * rep
    for t in set(output):
        row[t] -= freq * output.count(t) + pres
    return row


@pytest.mark.parametrize("rep, pres, freq, bias", [(1.3, 0.0, 0.0, {}), (1.0, 0.7, 0.4, {}),
                                                   (0.8, -0.5, 1.1, {3: 2.0, 9: -100.0})])
def test_row_processing_matches_the_formulas(rep, pres, freq, bias):
    row = torch.randn(64, generator=torch.Generator().manual_seed(1)) * 3
    prompt, output = [1, 2, 3, 3, 60], [3, 9, 9, 9, 17]
    p = SamplingParams(repetition_penalty=rep, presence_penalty=pres, frequency_penalty=freq, logit_bias=bias)
    got = row.clone()
    process_row(got, p, prompt, output)
    torch.testing.assert_close(got, _direct(row, prompt, output, rep, pres, freq, bias))


@pytest.fixture(scope="module")
def llm(qwen2_vl_tiny):
    return LLM(model=qwen2_vl_tiny, device="cpu")


def test_sampled_logprobs_are_raw(llm, qwen2_vl_tiny):
    p = SamplingParams(max_tokens=8, temperature=0.7, seed=3, ignore_eos=True, logprobs=3, presence_penalty=1.0)
    out = llm.generate({"prompt_token_ids": PROMPT}, p)[0].outputs[0]
    hf = load_checkpoint(qwen2_vl_tiny, "cpu", torch.float32).model
    ids = torch.tensor([PROMPT + out.token_ids])
    with torch.inference_mode():
        logits = hf(input_ids=ids, attention_mask=torch.ones_like(ids)).logits[0].float()
    lp = torch.log_softmax(logits[len(PROMPT) - 1 : -1], dim=-1)  # the distribution each output token came from
    assert len(out.logprobs) == len(out.token_ids)
    for i, (t, got) in enumerate(zip(out.token_ids, out.logprobs)):
        assert abs(got.logprob - lp[i, t].item()) < 1e-4
        assert list(got.top_ids) == lp[i].topk(3).indices.tolist()


def test_resumed_outputs_count_as_output(llm):
    def run(prompt, n, resumed=0):
        p = SamplingParams(max_tokens=n, ignore_eos=True, logit_bias={52: 3.0}, presence_penalty=1.5,
                           resumed_outputs=resumed)
        return llm.generate({"prompt_token_ids": prompt}, p)[0].outputs[0].token_ids

    full = run(PROMPT, 12)
    assert full[0] == 52  # the bias makes 52 the first token; the presence penalty keeps it from coming back
    for k in (1, 3):
        assert run(PROMPT + full[:k], 12 - k, resumed=k) == full[k:]
    assert run(PROMPT + full[:1], 11) != full[1:]  # without it, 52 counts as prompt: the penalty does not see it


@pytest.mark.parametrize("kw, name", [(dict(presence_penalty=2.5), "presence_penalty"),
                                      (dict(frequency_penalty=float("nan")), "frequency_penalty"),
                                      (dict(repetition_penalty=0.0), "repetition_penalty"),
                                      (dict(logit_bias={5: 101.0}), "logit_bias"),
                                      (dict(logprobs=21), "logprobs")])
def test_bad_values_are_refused_by_name(kw, name):
    with pytest.raises(ValueError, match=name):
        SamplingParams(**kw)
