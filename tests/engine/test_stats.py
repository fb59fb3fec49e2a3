"""EngineStats: every step's host time (schedule, inputs, update) is recorded apart from its forward."""
import pytest

from epdserve import LLM, SamplingParams


@pytest.fixture(scope="module")
def llm(qwen2_vl_tiny):
    return LLM(model=qwen2_vl_tiny, device="cpu")


def test_host_time_split_adds_up(llm):
    before = llm.engine.stats.as_dict()
    llm.generate(["one prompt", "another, longer prompt here"], SamplingParams(max_tokens=6, ignore_eos=True))
    s = {k: v - before[k] for k, v in llm.engine.stats.as_dict().items()}
    assert s["steps"] >= 6 and 0 < s["decode_steps"] < s["steps"]
    for k in ("schedule_s", "inputs_s", "update_s", "forward_s", "decode_host_s", "decode_forward_s"):
        assert s[k] > 0, k
    assert s["host_s"] == pytest.approx(s["schedule_s"] + s["inputs_s"] + s["update_s"])
    assert s["prefill_s"] + s["decode_s"] == pytest.approx(s["inputs_s"] + s["forward_s"])
    assert s["decode_host_s"] < s["host_s"] and s["decode_forward_s"] < s["forward_s"]
