"""Operators per LM layer per decode step (issue 36's aim: at most 25 on the CPU, from 68 before
the lean runner), counted as the issue defines it: every operator dispatched (a
`TorchDispatchMode`) during an offline generate of 16 new tokens minus one of 8, over 8 steps,
over the layers, batch 4, the small demo model (8 layers). Per-step work (embedding, rotary gather, upload views,
LM head, argmax) is included, spread over the layers, as in the issue's count."""
import collections

import pytest
from torch.utils._python_dispatch import TorchDispatchMode

from epdserve import LLM, SamplingParams
from epdserve.model.demo import build_demo_model

LIMIT = 25


class _Count(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.ops = collections.Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops[str(func.overloadpacket)] += 1
        return func(*args, **(kwargs or {}))


@pytest.fixture(scope="module")
def llm(tmp_path_factory):
    d = build_demo_model(tmp_path_factory.mktemp("small"), arch="qwen2_vl", size="small", seed=0)
    return LLM(d, device="cpu")


def _count(llm, n: int) -> collections.Counter:
    c = _Count()
    prompts = [f"tell me a story number {i} about dragons" for i in range(4)]
    with c:
        llm.generate(prompts, SamplingParams(max_tokens=n, ignore_eos=True))
    return c.ops


def test_operators_per_layer_per_decode_step(llm):
    _count(llm, 4)
    a, b = _count(llm, 8), _count(llm, 16)
    per_step = {k: (b[k] - a[k]) / 8 for k in b if b[k] != a[k]}
    layers = llm.engine.model.adapter.num_layers
    per_layer = sum(per_step.values()) / layers
    top = sorted(per_step.items(), key=lambda kv: -kv[1])[:12]
    print(f"{per_layer:.1f} operators per layer per decode step ({layers} layers): {top}")
    assert per_layer <= LIMIT, top
    assert per_step.get("epdserve.paged_decode_attention") == layers  # one attention call per layer
