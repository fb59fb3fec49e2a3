"""Fixtures for scheduler tests: real EPD engine instances on loopback and offline references."""
import pytest

from epdserve.engine.sampling_params import SamplingParams
from epdserve.entrypoints.llm import LLM
from tests.hf_oracle import HFOracle
from tests.scheduler.engine_instance import EngineInstance
from tests.scheduler.harness import start_scheduler


@pytest.fixture(scope="module")
def offline(qwen2_vl_tiny):
    """The reference outputs: the offline engine (LLM) on the same checkpoint, each answer also
    checked against transformers' own processor and `generate` (`tests.hf_oracle`), so a test that
    equals it equals transformers, not only epdserve's other path."""
    llm = LLM(str(qwen2_vl_tiny), device="cpu")
    hf = HFOracle(qwen2_vl_tiny)
    seen: dict = {}

    def reference(prompt: str, images: list[bytes], max_tokens: int, **sampling) -> list[int]:
        key = (prompt, tuple(images), max_tokens, tuple(sorted(sampling.items())))
        if key not in seen:
            assert set(sampling) <= {"ignore_eos"}, f"the transformers check is greedy only: {sampling}"
            params = SamplingParams(max_tokens=max_tokens, **sampling)
            out = llm.generate({"prompt": prompt, "multi_modal_data": {"image": images}}, params)
            assert out[0].error is None, out[0].error
            ids = out[0].outputs[0].token_ids
            assert ids == hf.generate(prompt, images, max_tokens, **sampling), f"offline != transformers: {prompt!r}"
            seen[key] = ids
        return seen[key]

    reference.llm = llm
    reference.hf = hf
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
