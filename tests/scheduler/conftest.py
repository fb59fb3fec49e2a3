"""Fixtures for scheduler tests: real EPD engine instances on loopback and offline references."""
import pytest

from epdserve.engine.sampling_params import SamplingParams
from epdserve.entrypoints.llm import LLM
from tests.scheduler.engine_instance import EngineInstance
from tests.scheduler.harness import start_scheduler


@pytest.fixture(scope="module")
def offline(qwen2_vl_tiny):
    """The offline engine (LLM) on the same checkpoint: the reference outputs."""
    llm = LLM(str(qwen2_vl_tiny), device="cpu")

    def reference(prompt: str, images: list[bytes], max_tokens: int, **sampling) -> list[int]:
        params = SamplingParams(max_tokens=max_tokens, **sampling)
        out = llm.generate({"prompt": prompt, "multi_modal_data": {"image": images}}, params)
        assert out[0].error is None, out[0].error
        return out[0].outputs[0].token_ids

    reference.llm = llm
    return reference


@pytest.fixture(scope="module")
def two_instances(qwen2_vl_tiny):
    insts = [EngineInstance(qwen2_vl_tiny, f"epd{i}").start() for i in range(2)]
    yield insts
    for i in insts:
        i.stop()


@pytest.fixture(scope="module")
def scheduler(qwen2_vl_tiny, two_instances):
    sched = start_scheduler(qwen2_vl_tiny, two_instances)
    yield sched
    sched.stop()
