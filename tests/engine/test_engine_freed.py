"""An engine nobody references is freed at once, by reference counting, with its KV cache (1 GiB
by default): no reference cycle holds it until the cycle collector happens to run. A cycle here
(a bound method of the engine handed to one of its parts) once let every test's engine linger,
and CI's workers grew by a KV cache a test until the kernel killed them."""
from __future__ import annotations

import gc
import weakref

import pytest

from epdserve import SamplingParams
from epdserve.engine.config import EngineConfig
from epdserve.engine.engine_request import EngineRequest
from epdserve.engine.llm_engine import LLMEngine
from epdserve.engine.structured_output import StructuredOutput


def _served(model_dir, n: int, structured) -> weakref.ref:
    """A weak reference to an engine that served one request to the end, then was dropped."""
    eng = LLMEngine(EngineConfig(model=str(model_dir), device="cpu", kv_cache_bytes=8 << 20))
    eng.add_request(EngineRequest("r", [1, 2, 3, 4, 5], [], SamplingParams(max_tokens=4, n=n, structured=structured)))
    finished = 0
    while eng.has_unfinished() or eng.has_pending_transfers():
        finished += sum(o.finished for o in eng.step())
    assert finished == n
    return weakref.ref(eng)


@pytest.mark.parametrize("n,structured", [(1, None), (3, None), (3, StructuredOutput("json_object"))],
                         ids=["one", "a group", "a group under a grammar"])
def test_a_dropped_engine_is_freed_without_the_cycle_collector(qwen2_vl_tiny, n, structured):
    _served(qwen2_vl_tiny, 1, None)  # a process's first engine may stay pinned by import-time frames
    gc.collect()
    gc.disable()
    try:
        ref = _served(qwen2_vl_tiny, n, structured)
        assert ref() is None, "the engine is held by a reference cycle"
    finally:
        gc.enable()
